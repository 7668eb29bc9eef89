//! A TCP proxy the test controls, between daemons and PostgreSQL: it can cut every connection
//! and refuse new ones (a host cut off from the database), and lose the next answer the
//! server sends (the connection drops after the request reached the server: a COMMIT that
//! landed without its acknowledgment).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    cut: AtomicBool,
    /// Answers still to lose: each drops the connection that was about to receive it.
    lose: AtomicU64,
    /// How many answers were lost.
    lost: AtomicU64,
    conns: Mutex<Vec<TcpStream>>,
}

impl State {
    fn close_all(&self) {
        for s in self.conns.lock().expect("proxy connections").drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Proxy {
    /// Forwards 127.0.0.1:<port> to 127.0.0.1:<target>.
    pub fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        let port = listener.local_addr().expect("proxy address").port();
        let state = Arc::new(State::default());
        let st = Arc::clone(&state);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if st.cut.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                {
                    let mut conns = st.conns.lock().expect("proxy connections");
                    conns.retain(|s| s.peer_addr().is_ok());
                    for s in [&client, &server] {
                        if let Ok(c) = s.try_clone() {
                            conns.push(c);
                        }
                    }
                }
                let (c2, s2) = match (client.try_clone(), server.try_clone()) {
                    (Ok(c), Ok(s)) => (c, s),
                    _ => continue,
                };
                let up = Arc::clone(&st);
                std::thread::spawn(move || pump(client, server, &up, false));
                let down = Arc::clone(&st);
                std::thread::spawn(move || pump(s2, c2, &down, true));
            }
        });
        Proxy { port, state }
    }

    /// Cuts every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.state.cut.store(true, Ordering::SeqCst);
        self.state.close_all();
    }

    pub fn restore(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
    }

    /// The next `n` answers from the server are lost, each with its connection.
    pub fn lose_answers(&self, n: u64) {
        self.state.lose.fetch_add(n, Ordering::SeqCst);
    }

    /// How many answers were lost so far.
    pub fn lost(&self) -> u64 {
        self.state.lost.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to` until either side closes. On the server's side, an answer may be
/// lost instead: the request reached the server, the reply never reaches the client.
fn pump(mut from: TcpStream, mut to: TcpStream, st: &State, answers: bool) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if answers
            && st
                .lose
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1))
                .is_ok()
        {
            st.lost.fetch_add(1, Ordering::SeqCst);
            break;
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
