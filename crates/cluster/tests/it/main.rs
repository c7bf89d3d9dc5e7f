//! In-process cluster tests over the in-memory transport.

mod harness;
mod t10_basic;
mod t20_failures;
mod t30_membership;
mod t40_sockets;
mod t50_chaos;
