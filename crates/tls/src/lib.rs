//! The cluster CA: how Warren nodes prove to each other that they belong.
//!
//! One [`ClusterCa`] per cluster signs a certificate per node
//! ([`NodeIdentity`]). The CA is generated once and shared as files, or
//! derived by every node from a seed they share ([`ClusterCa::derive`]).
//! Links between nodes (QUIC always, TCP unless TLS is turned off) use
//! mutual TLS: each side presents its node certificate and accepts only
//! certificates signed by the cluster CA. A node without one is refused during
//! the TLS handshake. Every node certificate carries the DNS name
//! [`CLUSTER_SERVER_NAME`], which dialers use as the server name; the node's
//! *name* is proven separately by the cluster-secret handshake.
//!
//! Node identities load from PEM, so an operator can also produce them with
//! other tools and give the files to `warren`.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    PKCS_ED25519,
};
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};

/// The DNS name every node certificate carries and every dialer expects.
pub const CLUSTER_SERVER_NAME: &str = "warren.cluster";

/// TLS set-up errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// Generating a key or certificate failed.
    #[error("generating a certificate failed: {0}")]
    Generate(#[from] rcgen::Error),
    /// A PEM file could not be read.
    #[error("could not read the {what} PEM: {reason}")]
    Pem {
        /// Which PEM (certificate, key, CA).
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration refused: {0}")]
    Config(String),
}

/// The cluster's certificate authority (certificate and signing key).
pub struct ClusterCa {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

/// An Ed25519 private key in PKCS#8 v1 (RFC 8410) is this prefix and the 32-byte seed.
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

impl ClusterCa {
    /// A new self-signed CA for one cluster.
    pub fn generate(cluster_name: &str) -> Result<Self, TlsError> {
        Self::self_signed(
            &format!("Warren cluster CA {cluster_name}"),
            KeyPair::generate()?,
        )
    }

    /// The CA whose Ed25519 key is `seed`: the same seed always gives the
    /// same CA name and key, so nodes that share a secret and derive the
    /// seed from it trust each other's certificates without sharing files.
    /// Anyone who knows the seed can issue certificates: it must be secret,
    /// and hard to guess.
    pub fn derive(seed: &[u8; 32]) -> Result<Self, TlsError> {
        let mut pkcs8 = ED25519_PKCS8_PREFIX.to_vec();
        pkcs8.extend_from_slice(seed);
        let key =
            KeyPair::from_pkcs8_der_and_sign_algo(&PrivatePkcs8KeyDer::from(pkcs8), &PKCS_ED25519)?;
        Self::self_signed("Warren cluster CA (derived)", key)
    }

    fn self_signed(name: &str, key: KeyPair) -> Result<Self, TlsError> {
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Signs a new certificate for node `node_name`.
    pub fn issue(&self, node_name: &str) -> Result<NodeIdentity, TlsError> {
        let mut params = CertificateParams::new(vec![CLUSTER_SERVER_NAME.to_owned()])?;
        params
            .distinguished_name
            .push(DnType::CommonName, node_name);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        NodeIdentity::from_pem(&cert.pem(), &key.serialize_pem(), &self.cert_pem)
    }
}

/// One node's certificate and key, plus the CA it trusts.
#[derive(Debug)]
pub struct NodeIdentity {
    cert_chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        Self {
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
            roots: self.roots.clone(),
        }
    }
}

fn pem_err(what: &'static str) -> impl Fn(rustls_pki_types::pem::Error) -> TlsError {
    move |e| TlsError::Pem {
        what,
        reason: e.to_string(),
    }
}

impl NodeIdentity {
    /// Loads a node identity from PEM: its certificate (chain), its key, the CA certificate.
    pub fn from_pem(cert_pem: &str, key_pem: &str, ca_pem: &str) -> Result<Self, TlsError> {
        let cert_chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(pem_err("node certificate"))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(pem_err("node key"))?;
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots
                .add(ca.map_err(pem_err("CA certificate"))?)
                .map_err(|e| TlsError::Config(e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(TlsError::Pem {
                what: "CA certificate",
                reason: "no certificate found".into(),
            });
        }
        Ok(Self {
            cert_chain,
            key,
            roots: Arc::new(roots),
        })
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// A server config that requires a client certificate from the cluster CA.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, TlsError> {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), Self::provider())
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.cert_chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(e.to_string()))?;
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(cfg)
    }

    /// A client config that presents this node's certificate and trusts only the cluster CA.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Result<rustls::ClientConfig, TlsError> {
        let mut cfg = rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.cert_chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(e.to_string()))?;
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(cfg)
    }

    /// The server name dialers verify ([`CLUSTER_SERVER_NAME`]).
    pub fn server_name() -> ServerName<'static> {
        ServerName::try_from(CLUSTER_SERVER_NAME).expect("a valid DNS name")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issues_identities_that_build_configs() {
        let ca = ClusterCa::generate("test").unwrap();
        let id = ca.issue("warren@127.0.0.1").unwrap();
        id.server_config(&[b"warren"]).unwrap();
        id.client_config(&[b"warren"]).unwrap();
    }

    #[test]
    fn a_derived_ca_depends_on_its_seed_alone() {
        let key = |ca: &ClusterCa| ca.issuer.key().public_key_raw().to_vec();
        let (a, b) = (ClusterCa::derive(&[7; 32]), ClusterCa::derive(&[7; 32]));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(key(&a), key(&b));
        assert_ne!(key(&a), key(&ClusterCa::derive(&[8; 32]).unwrap()));
        a.issue("warren@a").unwrap().server_config(&[b"w"]).unwrap();
    }

    #[test]
    fn garbage_pem_is_a_clear_error() {
        let err = NodeIdentity::from_pem("nope", "nope", "nope").unwrap_err();
        assert!(err.to_string().contains("PEM"), "{err}");
    }
}
