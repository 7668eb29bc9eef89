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
    /// The next request containing this is never delivered: its connection drops (once a
    /// request containing `drop_after` went through, if that is set).
    drop_request: Mutex<Option<Vec<u8>>>,
    drop_after: Mutex<Option<Vec<u8>>>,
    /// The next request containing this is delivered, and its answer lost with the connection.
    lose_answer_to: Mutex<Option<Vec<u8>>>,
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// Takes the pattern in `slot` if `chunk` contains it (each pattern acts once).
fn takes(slot: &Mutex<Option<Vec<u8>>>, chunk: &[u8]) -> bool {
    let mut p = slot.lock().expect("proxy pattern");
    if p.as_deref().is_some_and(|p| contains(chunk, p)) {
        *p = None;
        return true;
    }
    false
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
                // Set by the client side when an answer to come is to be lost: how many
                // answers go through first, plus one.
                let armed = Arc::new(AtomicU64::new(0));
                let (up, a) = (Arc::clone(&st), Arc::clone(&armed));
                std::thread::spawn(move || pump(client, server, &up, false, &a));
                let down = Arc::clone(&st);
                std::thread::spawn(move || pump(s2, c2, &down, true, &armed));
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

    /// The next request whose bytes contain `pattern` never reaches the server: its connection
    /// drops instead.
    pub fn drop_request(&self, pattern: &str) {
        *self.state.drop_request.lock().expect("proxy pattern") = Some(pattern.into());
    }

    /// [`Proxy::drop_request`], for the first such request after one containing `after`.
    pub fn drop_request_after(&self, after: &str, pattern: &str) {
        *self.state.drop_after.lock().expect("proxy pattern") = Some(after.into());
        self.drop_request(pattern);
    }

    /// The next statement whose text contains `pattern` reaches the server and runs, and the
    /// answer to its execution (the round trip after the one that carried its text) is lost
    /// with its connection.
    pub fn lose_answer_to(&self, pattern: &str) {
        *self.state.lose_answer_to.lock().expect("proxy pattern") = Some(pattern.into());
    }
}

/// Copies `from` to `to` until either side closes. On the server's side, an answer may be
/// lost instead: the request reached the server, the reply never reaches the client.
fn pump(mut from: TcpStream, mut to: TcpStream, st: &State, answers: bool, armed: &AtomicU64) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if !answers && !st.drop_after.lock().expect("proxy pattern").is_some() {
            if takes(&st.drop_request, &buf[..n]) {
                break;
            }
        } else if !answers {
            takes(&st.drop_after, &buf[..n]);
        }
        if !answers && takes(&st.lose_answer_to, &buf[..n]) {
            // The statement's text goes with its Parse; the answer that says what it did
            // comes after the next round trip (Bind and Execute).
            armed.store(2, Ordering::SeqCst);
        }
        let lose_this = answers
            && armed
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |a| a.checked_sub(1))
                .is_ok_and(|a| a == 1);
        if answers
            && (lose_this
                || st
                    .lose
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1))
                    .is_ok())
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
