//! The executor's HTTP client against a scripted server on a socket: bodies by length,
//! chunks and the connection's end, kept connections and stale ones, writes on connections
//! of their own with their gate, proxies, limits and timeouts.

use super::*;
use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// What the server saw: each request's connection number and its text.
type Seen = Arc<Mutex<Vec<(usize, String)>>>;

/// A server that answers the requests it reads, in turn, with `answers`; an answer ending
/// in `CLOSE` closes its connection after it is written; once they run out, a request gets
/// no answer. Each connection is served by a thread of its own.
fn server(answers: Vec<&'static str>) -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let answers = Arc::new(Mutex::new(answers.into_iter()));
    std::thread::spawn(move || {
        for (n, conn) in listener.incoming().enumerate() {
            let (mut conn, log, answers) = (conn.unwrap(), log.clone(), answers.clone());
            std::thread::spawn(move || {
                while let Some(request) = read_request(&mut conn) {
                    log.lock().unwrap().push((n, request));
                    let next = answers.lock().unwrap().next();
                    let Some(answer) = next else {
                        // Nothing more to say: hold the connection, answer nothing.
                        std::thread::sleep(Duration::from_secs(30));
                        return;
                    };
                    let close = answer.ends_with("CLOSE");
                    let _ = conn.write_all(answer.trim_end_matches("CLOSE").as_bytes());
                    if close {
                        return;
                    }
                }
            });
        }
    });
    (url, seen)
}

fn read_request(conn: &mut std::net::TcpStream) -> Option<String> {
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte).ok()? == 0 {
            return None;
        }
        got.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&got).to_string();
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .map_or(0, |n| n.trim().parse().unwrap());
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body).ok()?;
    Some(head + &String::from_utf8_lossy(&body))
}

fn run<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

fn get(url: &str) -> Request {
    Request::new("GET", url, Duration::from_secs(10)).unwrap()
}

const OK: &str = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";

#[test]
fn a_body_by_length_by_chunks_and_by_the_connections_end() {
    let (url, seen) = server(vec![
        OK,
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n4;ext=1\r\nWiki\r\n6\r\npedia \r\n0\r\nTrailer: x\r\n\r\n",
        "HTTP/1.0 200 OK\r\n\r\nto the endCLOSE",
    ]);
    run(async {
        let a = send(get(&format!("{url}/a?x=1")), 100).await.unwrap();
        assert_eq!((a.status, a.body.unwrap()), (200, "hello".to_string()));
        let b = send(get(&format!("{url}/b")), 100).await.unwrap();
        assert_eq!(b.status, 201);
        assert_eq!(b.headers.get("x-a").unwrap(), "1");
        assert_eq!(b.body.unwrap(), "Wikipedia ");
        let c = send(get(&format!("{url}/c")), 100).await.unwrap();
        assert_eq!(c.body.unwrap(), "to the end");
    });
    let seen = seen.lock().unwrap();
    // One connection carried all three, kept between them.
    assert_eq!(seen.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [0, 0, 0]);
    assert!(
        seen[0]
            .1
            .starts_with("GET /a?x=1 HTTP/1.1\r\nHost: 127.0.0.1:"),
        "{}",
        seen[0].1
    );
}

#[test]
fn a_kept_connection_found_closed_is_replaced_before_any_answer() {
    let (url, seen) = server(vec![
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirstCLOSE",
        OK,
    ]);
    run(async {
        assert_eq!(send(get(&url), 100).await.unwrap().body.unwrap(), "first");
        // The server closed the kept connection: the next request goes on a new one.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(send(get(&url), 100).await.unwrap().body.unwrap(), "hello");
    });
    let conns: Vec<usize> = seen.lock().unwrap().iter().map(|(n, _)| *n).collect();
    assert_eq!(conns, [0, 1]);
}

#[test]
fn a_write_goes_on_a_connection_of_its_own_and_asks_its_gate_once_connected() {
    let (url, seen) = server(vec![OK, OK, OK]);
    let asked = Arc::new(Mutex::new(0));
    let counted = asked.clone();
    let gate: Ready = Arc::new(move || {
        *counted.lock().unwrap() += 1;
        Ok(())
    });
    run(async {
        send(get(&url), 100).await.unwrap();
        let post = Request::new("POST", &url, Duration::from_secs(5))
            .unwrap()
            .header("Idempotency-Key", "k1")
            .unwrap()
            .body(bytes::Bytes::from_static(b"{}"))
            .write(Some(gate));
        assert_eq!(send(post, 100).await.unwrap().status, 200);
        // The read after it reuses the first connection, not the write's.
        send(get(&url), 100).await.unwrap();
    });
    assert_eq!(*asked.lock().unwrap(), 1);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [0, 1, 0]);
    assert!(seen[1].1.contains("Connection: close\r\n"), "{}", seen[1].1);
    assert!(seen[1].1.contains("Content-Length: 2\r\n"), "{}", seen[1].1);
    assert!(seen[1].1.ends_with("\r\n\r\n{}"), "{}", seen[1].1);
}

#[test]
fn a_refused_gate_sends_nothing_and_says_why() {
    let (url, seen) = server(vec![OK]);
    let gate: Ready = Arc::new(|| Err("the claim was taken over".into()));
    let post = Request::new("POST", &url, Duration::from_secs(5))
        .unwrap()
        .write(Some(gate));
    let e = run(send(post, 100)).err().unwrap();
    assert_eq!(e, Error::Refused("the claim was taken over".into()));
    std::thread::sleep(Duration::from_millis(50));
    assert!(seen.lock().unwrap().is_empty());
}

#[test]
fn failures_say_what_of_the_request_may_have_left() {
    // Nothing listens: no connection, nothing sent.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = run(send(get(&format!("http://127.0.0.1:{port}/")), 100))
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Connect(t) if t.contains("cannot connect")),
        "{e:?}"
    );
    // A server that reads and never answers: a timeout.
    let (url, _) = server(vec![]);
    let slow = Request::new("GET", &url, Duration::from_millis(300)).unwrap();
    assert_eq!(run(send(slow, 100)).err(), Some(Error::Timeout));
    // A body over the limit: the status is kept, the body says why.
    let (url, _) = server(vec![OK]);
    let r = run(send(get(&url), 3)).unwrap();
    assert_eq!(r.status, 200);
    assert!(r.body.unwrap_err().contains("over the limit of 3 bytes"));
    // A cut-off body is not a body.
    let (url, _) = server(vec!["HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nhelCLOSE"]);
    let r = run(send(get(&url), 100)).unwrap();
    assert!(r.body.unwrap_err().contains("closed before the body's end"));
    // What cannot be sent is refused before any connection.
    let bad = get("http://127.0.0.1:1/").header("X-Key", "a\r\nInjected: 1");
    assert!(matches!(bad.err(), Some(Error::Invalid(_))));
}

#[test]
fn a_proxy_gets_the_absolute_url_and_its_credentials() {
    let (proxy_url, seen) = server(vec![OK]);
    let proxies = route::Proxies::from_vars(|n| {
        (n == "HTTP_PROXY").then(|| proxy_url.replace("http://", "http://me:secret@"))
    });
    let r = run(send_via(
        get("http://api.example.test:8080/v1/x?q=1"),
        100,
        &proxies,
    ))
    .unwrap();
    assert_eq!(r.body.unwrap(), "hello");
    let seen = seen.lock().unwrap();
    let request = &seen[0].1;
    assert!(
        request.starts_with(
            "GET http://api.example.test:8080/v1/x?q=1 HTTP/1.1\r\nHost: api.example.test:8080\r\n"
        ),
        "{request}"
    );
    // "me:secret" in base64.
    assert!(
        request.contains("Proxy-Authorization: Basic bWU6c2VjcmV0\r\n"),
        "{request}"
    );
}

#[test]
fn a_proxy_that_refuses_a_tunnel_is_a_connection_not_made() {
    let (proxy_url, seen) = server(vec![
        "HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n",
    ]);
    let proxies = route::Proxies::from_vars(|n| (n == "HTTPS_PROXY").then(|| proxy_url.clone()));
    let e = run(send_via(get("https://api.example.test/v1"), 100, &proxies))
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Connect(t) if t.contains("refused a tunnel") && t.contains("407")),
        "{e:?}"
    );
    assert!(
        seen.lock().unwrap()[0]
            .1
            .starts_with("CONNECT api.example.test:443 HTTP/1.1\r\n")
    );
}

#[test]
fn a_chunk_size_past_the_limit_is_refused_before_it_is_read() {
    let (url, _) = server(vec![
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\nffffffffffffffff\r\nxx",
    ]);
    let r = run(send(get(&url), 1000)).unwrap();
    assert!(r.body.unwrap_err().contains("over the limit of 1000 bytes"));
    let (url, _) = server(vec![
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10000000000000000\r\nxx",
    ]);
    let r = run(send(get(&url), 1000)).unwrap();
    assert!(r.body.unwrap_err().contains("not a hex number"));
}

#[test]
fn lengths_that_disagree_or_are_not_digits_are_not_a_body() {
    for (head, why) in [
        ("Content-Length: 5\r\nContent-Length: 6", "two different"),
        ("Content-Length: +5", "not a number"),
        ("Content-Length: 5, 6", "two different"),
    ] {
        let answer: &'static str =
            Box::leak(format!("HTTP/1.1 200 OK\r\n{head}\r\n\r\nhello").into_boxed_str());
        let (url, _) = server(vec![answer]);
        let r = run(send(get(&url), 100)).unwrap();
        assert!(r.body.unwrap_err().contains(why), "{head}");
    }
    // Both framings: the chunks tell, and the connection is not used again.
    let (url, seen) = server(vec![
        "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        OK,
    ]);
    run(async {
        assert_eq!(send(get(&url), 100).await.unwrap().body.unwrap(), "ok");
        assert_eq!(send(get(&url), 100).await.unwrap().body.unwrap(), "hello");
    });
    let conns: Vec<usize> = seen.lock().unwrap().iter().map(|(n, _)| *n).collect();
    assert_eq!(conns, [0, 1]);
    assert!(seen.lock().unwrap()[0].1.contains("Accept: */*\r\n"));
}

#[test]
fn bytes_nobody_asked_for_on_a_kept_connection_are_never_the_next_answer() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for (n, conn) in listener.incoming().enumerate() {
            let mut conn = conn.unwrap();
            std::thread::spawn(move || {
                while read_request(&mut conn).is_some() {
                    let body = if n == 0 { "first" } else { "fresh" };
                    let answer = format!("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{body}");
                    conn.write_all(answer.as_bytes()).unwrap();
                    if n == 0 {
                        // A late answer to nothing, as a confused server sends.
                        std::thread::sleep(Duration::from_millis(100));
                        let _ =
                            conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nINJECTED");
                    }
                }
            });
        }
    });
    run(async {
        assert_eq!(send(get(&url), 100).await.unwrap().body.unwrap(), "first");
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(send(get(&url), 100).await.unwrap().body.unwrap(), "fresh");
    });
}

#[test]
fn running_out_of_time_before_the_gate_lets_a_write_go_is_a_connection_not_made() {
    let (url, seen) = server(vec![OK]);
    let gate: Ready = Arc::new(|| {
        std::thread::sleep(Duration::from_millis(600));
        Ok(())
    });
    let post = Request::new("POST", &url, Duration::from_millis(200))
        .unwrap()
        .write(Some(gate));
    let e = run(send(post, 100)).err().unwrap();
    assert!(
        matches!(&e, Error::Connect(t) if t.contains("nothing was sent")),
        "{e:?}"
    );
    std::thread::sleep(Duration::from_millis(600));
    assert!(seen.lock().unwrap().is_empty());
}

#[test]
fn a_kept_connection_that_took_the_request_and_closed_is_not_nothing_sent() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        read_request(&mut conn).unwrap();
        conn.write_all(OK.as_bytes()).unwrap();
        // No new connection from here on; the next request arrives, and gets no answer.
        drop(listener);
        read_request(&mut conn).unwrap();
    });
    run(async {
        assert_eq!(send(get(&url), 100).await.unwrap().body.unwrap(), "hello");
        let e = send(get(&url), 100).await.err().unwrap();
        assert!(
            matches!(&e, Error::Lost(t) if t.contains("kept connection closed")),
            "{e:?}"
        );
    });
}
