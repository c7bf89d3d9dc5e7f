//! An accepted connection handed from the listener's runtime to a service on
//! another (`Connection::follow_next_poller`, as the node's peer port does)
//! moves its socket there: it keeps working after the listener's runtime,
//! and with it that runtime's I/O driver, is gone.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use warren_tls::ClusterCa;
use warren_transport::conformance::{SECRET, config};
use warren_transport::{PeerAddr, Transport};
use warren_transport_tcp::TcpTransport;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime")
}

fn transport(node: &str, ca: Option<&ClusterCa>) -> Arc<dyn Transport> {
    let config = config(node, SECRET, 1 << 20);
    match ca {
        None => Arc::new(TcpTransport::new(config)),
        Some(ca) => {
            let id = ca.issue(node).expect("node certificate");
            Arc::new(TcpTransport::with_tls(config, &id).expect("TLS config"))
        }
    }
}

#[test]
fn an_accepted_connection_moves_to_the_runtime_that_polls_it() {
    let ca = ClusterCa::generate("runtimes").expect("CA");
    for tls in [None, Some(&ca)] {
        let listening = runtime();
        let serving = runtime();
        let (server, client) = (transport("a@x", tls), transport("b@x", tls));
        let mut listener = listening
            .block_on(server.listen(&PeerAddr::new("127.0.0.1:0")))
            .expect("listen");
        let addr = listener.local_addr();
        let dialed = serving.spawn(async move { client.connect(&addr).await });
        let accepted = listening
            .block_on(listener.accept())
            .expect("an accepted connection");
        accepted.follow_next_poller();
        drop(listener);
        listening.shutdown_timeout(Duration::from_secs(1));
        serving.block_on(async move {
            let mut dialed = dialed.await.expect("dial task").expect("dialed");
            let mut accepted = accepted;
            for i in 0..100u32 {
                let ping = Bytes::from(i.to_be_bytes().to_vec());
                dialed
                    .send(ping.clone())
                    .await
                    .expect("send to the acceptor");
                let got = tokio::time::timeout(Duration::from_secs(5), accepted.recv()).await;
                assert_eq!(
                    got.expect("read in time").expect("read"),
                    Some(ping.clone()),
                    "tls: {}",
                    tls.is_some()
                );
                accepted.send(ping.clone()).await.expect("send back");
                let back = tokio::time::timeout(Duration::from_secs(5), dialed.recv()).await;
                assert_eq!(back.expect("answer in time").expect("answer"), Some(ping));
            }
        });
    }
}
