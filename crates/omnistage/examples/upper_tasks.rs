//! The `upper` service written as async tasks (the guide's second style; see docs/guide.md).
//!
//! Each tenant has a port; a line sent there comes back in capitals. One accept task per
//! tenant runs in the tenant's activity; each connection is a task it spawns, which inherits
//! the activity. Every poll of those tasks is a dispatch of the task stage, charged to the
//! tenant and scheduled by the tenants' weights.
//!
//! `cargo run -p omnistage --example upper_tasks`

mod upper_common;

use omnistage::exec::{Affinity, Runtime};
use omnistage::task::{self, TaskConfig, TcpListener, TcpStream};
use upper_common::{upper, LINE_MAX};

/// One tenant's accept loop: a task per connection, in the same activity.
async fn serve(listener: std::net::TcpListener) {
    let listener = TcpListener::from_std(listener).expect("register the listener");
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                if let Err(e) = task::spawn(connection(stream)) {
                    eprintln!("upper_tasks: connection refused: {e}");
                }
            }
            Err(e) => eprintln!("upper_tasks: accept: {e}"),
        }
    }
}

/// One connection: read, answer each whole line, until the peer closes.
async fn connection(stream: TcpStream) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        let n = match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        while let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let reply = upper(&buf[..end]);
            buf.drain(..=end);
            if stream.write_all(&reply).await.is_err() {
                return;
            }
        }
        if buf.len() > LINE_MAX {
            return;
        }
    }
}

fn main() {
    let b = Runtime::builder()
        .workers(1)
        .tasks(TaskConfig::default())
        .expect("tasks");
    let (b, tenants) = upper_common::tenants(b);
    let rt = b.start().expect("start");
    let mut addrs = Vec::new();
    for (activity, listener) in tenants {
        addrs.push(listener.local_addr().expect("addr"));
        // The accept loop is built on its core (the listener is registered with that core's
        // poller), in the tenant's activity.
        rt.spawn_with(activity, Affinity::Core(0), move || serve(listener))
            .expect("spawn");
    }
    upper_common::check(&rt, &addrs);
}
