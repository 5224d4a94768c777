//! `http.upstream`: readiness of this worker's connections to backend servers (registered on
//! the worker's own poller, like the client connections). A connecting socket's first
//! readiness says whether the connect worked (a refusal backs the server off and the request
//! goes to another server or is answered 502); a busy one moves its request's bytes
//! ([`proxy::pump`](super::proxy::pump)); an idle pooled one that becomes readable was closed
//! by the server (or sent bytes nobody asked for) and is dropped. Runs in the activity of the
//! tenant whose request the connection carries (`/infra` while idle).

use super::core_server::with_core;
use super::proxy::{close_upstream, on_connect_failed, on_connected, pump};
use super::upstream_pool::UpState;
use omnistage::exec::{Ctx, IoEvent};

pub(super) fn on_upstream(ctx: &mut Ctx<'_>, ev: IoEvent) {
    with_core(|cs| {
        cs.refresh(ctx);
        let up = ev.user;
        let Some(u) = cs.proxy.conn(up) else { return };
        u.readable |= ev.readable || ev.closed;
        match u.state {
            UpState::Idle => {
                if ev.readable || ev.closed {
                    close_upstream(ctx, cs, up);
                }
            }
            UpState::Connecting => {
                if !(ev.writable || ev.readable || ev.closed) {
                    return;
                }
                let client = u.client;
                // The outcome of a non-blocking connect: an error, or a peer once connected.
                let failed = match u.stream.take_error() {
                    Ok(Some(_)) | Err(_) => true,
                    Ok(None) => match u.stream.peer_addr() {
                        Ok(_) => false,
                        Err(e) if e.kind() == std::io::ErrorKind::NotConnected => {
                            if ev.closed {
                                true
                            } else {
                                // Not yet: a later readiness says.
                                return;
                            }
                        }
                        Err(_) => true,
                    },
                };
                if failed {
                    on_connect_failed(ctx, cs, client);
                } else {
                    u.state = UpState::Busy;
                    on_connected(ctx, cs, client);
                }
            }
            UpState::Busy => {
                let client = u.client;
                pump(ctx, cs, client);
            }
        }
    });
}
