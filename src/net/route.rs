//! Where a request of the executor's HTTP client ([`super::h1`]) goes, and its connection:
//! the origin of its URL, the proxy the environment names for it (`HTTP_PROXY`,
//! `HTTPS_PROXY`, `ALL_PROXY`, `NO_PROXY`, as curl reads them), a TCP connection (through a
//! proxy's `CONNECT` tunnel for `https://`), TLS with the platform's roots, and the idle
//! connections kept per origin for requests that may be repeated.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

/// Where a URL's requests go: its scheme's security, host (brackets of an IPv6 address
/// kept) and port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Origin {
    pub tls: bool,
    pub host: String,
    pub port: u16,
}

impl Origin {
    /// The origin of an absolute `http://` or `https://` URI.
    pub fn of(uri: &http::Uri) -> Result<Origin, String> {
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(format!("{uri} is not an http:// or https:// URL")),
        };
        let auth = uri
            .authority()
            .filter(|a| !a.host().is_empty())
            .ok_or_else(|| format!("{uri} has no host"))?;
        // A port that is no port (99999, which `http` reads as none) is an error, never the
        // scheme's own port instead.
        let raw = auth.as_str();
        let after_host = &raw[raw.rfind(']').map_or(0, |i| i + 1)..];
        let port = match after_host.rsplit_once(':').map(|(_, p)| p) {
            None | Some("") => {
                if tls {
                    443
                } else {
                    80
                }
            }
            Some(p) => match p.parse::<u16>() {
                Ok(n) if n > 0 => n,
                _ => return Err(format!("{uri}: port {p} is not a port (1 to 65535)")),
            },
        };
        Ok(Origin {
            tls,
            host: auth.host().to_ascii_lowercase(),
            port,
        })
    }

    /// The `Host` header's value (the port only when it is not the scheme's own).
    pub fn authority(&self) -> String {
        if self.port == if self.tls { 443 } else { 80 } {
            self.host.clone()
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The host as a name or address to connect to (an IPv6 address without brackets).
    fn bare_host(&self) -> &str {
        self.host.trim_start_matches('[').trim_end_matches(']')
    }
}

/// A proxy named by the environment: where it listens, and its `Proxy-Authorization`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proxy {
    pub at: Origin,
    pub auth: Option<String>,
}

/// The proxies of the environment, read once.
#[derive(Debug, Default)]
pub struct Proxies {
    http: Option<Result<Proxy, String>>,
    https: Option<Result<Proxy, String>>,
    no_proxy: Vec<String>,
}

impl Proxies {
    /// The proxies that `var` names (`HTTP_PROXY` or `http_proxy`, `HTTPS_PROXY`, then
    /// `ALL_PROXY` for either; `NO_PROXY` the hosts that go direct).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Proxies {
        let get = |name: &str| {
            var(name)
                .or_else(|| var(&name.to_ascii_lowercase()))
                .filter(|v| !v.trim().is_empty())
        };
        let all = get("ALL_PROXY");
        let read = |name: &str| {
            let v = get(name).or_else(|| all.clone())?;
            Some(parse_proxy(&v).map_err(|why| format!("{name} or ALL_PROXY: {why}")))
        };
        Proxies {
            http: read("HTTP_PROXY"),
            https: read("HTTPS_PROXY"),
            no_proxy: get("NO_PROXY")
                .unwrap_or_default()
                .split(',')
                .map(|e| e.trim().to_ascii_lowercase())
                .filter(|e| !e.is_empty())
                .collect(),
        }
    }

    /// The proxy for `origin`, none, or why the one named cannot be used.
    pub fn route(&self, origin: &Origin) -> Result<Option<&Proxy>, String> {
        let named = if origin.tls { &self.https } else { &self.http };
        match named {
            None => Ok(None),
            Some(_) if self.bypassed(origin.bare_host()) => Ok(None),
            Some(Ok(p)) => Ok(Some(p)),
            Some(Err(why)) => Err(why.clone()),
        }
    }

    /// Whether `NO_PROXY` sends `host` direct: `*`, the host itself, a domain it is in
    /// (`example.com` or `.example.com`), or an address range (`10.0.0.0/8`).
    fn bypassed(&self, host: &str) -> bool {
        self.no_proxy.iter().any(|entry| {
            let domain = entry.trim_start_matches('.');
            entry == "*"
                || host == domain
                || host.ends_with(&format!(".{domain}"))
                || in_range(host, entry)
        })
    }
}

/// Whether the address `host` is in the range `cidr` (`10.0.0.0/8`, `fd00::/8`).
fn in_range(host: &str, cidr: &str) -> bool {
    let (Some((net, bits)), Ok(addr)) = (cidr.split_once('/'), host.parse::<IpAddr>()) else {
        return false;
    };
    let (Ok(net), Ok(bits)) = (net.parse::<IpAddr>(), bits.parse::<u32>()) else {
        return false;
    };
    let masked = |a: u128, width: u32| {
        let keep = bits.min(width);
        if keep == 0 { 0 } else { a >> (width - keep) }
    };
    match (addr, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            masked(u32::from(a).into(), 32) == masked(u32::from(n).into(), 32)
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => masked(a.into(), 128) == masked(n.into(), 128),
        _ => false,
    }
}

/// A proxy's URL (`http://[user:password@]host[:port]`, or `host:port` alone).
fn parse_proxy(text: &str) -> Result<Proxy, String> {
    let text = text.trim();
    let full = if text.contains("://") {
        text.to_string()
    } else {
        format!("http://{text}")
    };
    // Shown without its credentials: an error's text may reach a log, a task's result, and
    // from there a model.
    let shown = crate::limits::printable(&redacted(&full)).into_owned();
    let (scheme, rest) = full.split_once("://").unwrap_or(("http", &full));
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(format!(
            "{shown:?}: only an http:// proxy is supported (a tunnel through it still carries TLS)"
        ));
    }
    let (userinfo, after) = userinfo_of(rest);
    let hostport = after.split(['/', '?', '#']).next().unwrap_or_default();
    let uri: http::Uri = format!("http://{hostport}/")
        .parse()
        .map_err(|e| format!("{shown:?} is not a proxy URL: {e}"))?;
    let at = Origin::of(&uri).map_err(|e| format!("{shown:?}: {e}"))?;
    let auth = userinfo.map(|u| {
        use base64::Engine as _;
        // `+` is itself in a user name or password, not a space.
        let decoded = crate::httpd::percent_decode(&u.replace('+', "%2B"));
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(decoded)
        )
    });
    Ok(Proxy { at, auth })
}

/// A URL's part after `scheme://` split at its user name and password, if it has any: the
/// last `@` before the host ends them, so a password written with a raw `/`, `?` or `#` (as
/// people write them in proxy variables) is still the password, not a path.
fn userinfo_of(rest: &str) -> (Option<&str>, &str) {
    match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    }
}

/// A URL with its user name and password (if any) replaced by `***`.
fn redacted(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    match userinfo_of(rest) {
        (Some(_), after) => format!("{scheme}://***@{after}"),
        (None, _) => url.to_string(),
    }
}

/// The environment's proxies, read at the first request.
pub fn proxies() -> &'static Proxies {
    static P: OnceLock<Proxies> = OnceLock::new();
    P.get_or_init(|| Proxies::from_vars(|n| std::env::var(n).ok()))
}

/// A connection: plain TCP, or TLS over it (boxed: its buffers are large and most waiting
/// connections of a test or a bench are plain).
pub enum Conn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Conn {
    pub fn is_tls(&self) -> bool {
        matches!(self, Conn::Tls(_))
    }

    /// Waits until the socket has bytes to read (or is closed), without a buffer: a waiting
    /// request holds no read buffer until its answer begins. (For TLS, the bytes may be
    /// TLS's own records; the reader tries again.)
    pub async fn wait_readable(&self) -> std::io::Result<()> {
        match self {
            Conn::Plain(s) => s.readable().await,
            Conn::Tls(s) => s.get_ref().0.readable().await,
        }
    }

    /// Whether a kept connection may carry a request: open, and with nothing unasked for
    /// waiting on it (a late answer, or a server's farewell, would be read as the next
    /// request's).
    fn quiet(&mut self) -> bool {
        let mut probe = Vec::with_capacity(1);
        super::answer::try_read(self, &mut probe).is_pending()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A new connection to `origin`, through `proxy` when one is named: TCP, the proxy's tunnel
/// for TLS, then TLS. `Err` says why none was made (nothing of a request was sent).
pub async fn open(origin: &Origin, proxy: Option<&Proxy>) -> Result<Conn, String> {
    let to = proxy.map_or(origin, |p| &p.at);
    let mut tcp = TcpStream::connect((to.bare_host(), to.port))
        .await
        .map_err(|e| match proxy {
            Some(_) => format!("cannot connect to the proxy {}: {e}", to.authority()),
            None => format!("cannot connect to {}: {e}", to.authority()),
        })?;
    let _ = tcp.set_nodelay(true);
    if !origin.tls {
        return Ok(Conn::Plain(tcp));
    }
    if let Some(p) = proxy {
        tunnel(&mut tcp, origin, p).await?;
    }
    let name = rustls::pki_types::ServerName::try_from(origin.bare_host().to_string())
        .map_err(|e| format!("{} is not a name TLS can check: {e}", origin.host))?;
    let tls = tls()?
        .connect(name, tcp)
        .await
        .map_err(|e| format!("the TLS handshake with {} failed: {e}", origin.host))?;
    Ok(Conn::Tls(Box::new(tls)))
}

/// Asks `proxy` for a tunnel to `origin` (`CONNECT`), and reads its answer.
async fn tunnel(tcp: &mut TcpStream, origin: &Origin, proxy: &Proxy) -> Result<(), String> {
    let target = format!("{}:{}", origin.host, origin.port);
    let mut head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
    if let Some(auth) = &proxy.auth {
        head.push_str(&format!("Proxy-Authorization: {auth}\r\n"));
    }
    head.push_str("\r\n");
    let lost = |e: std::io::Error| format!("the proxy {} closed: {e}", proxy.at.authority());
    tcp.write_all(head.as_bytes()).await.map_err(lost)?;
    let mut answer = Vec::new();
    while !answer.ends_with(b"\r\n\r\n") {
        if answer.len() > 16 * 1024 {
            return Err("the proxy's answer to CONNECT is over 16 KB".into());
        }
        let byte = tcp.read_u8().await.map_err(lost)?;
        answer.push(byte);
    }
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut r = httparse::Response::new(&mut headers);
    match r.parse(&answer) {
        Ok(httparse::Status::Complete(_)) if r.code.is_some_and(|c| (200..300).contains(&c)) => {
            Ok(())
        }
        Ok(httparse::Status::Complete(_)) => Err(format!(
            "the proxy {} refused a tunnel to {target}: HTTP {}",
            proxy.at.authority(),
            r.code.unwrap_or(0)
        )),
        _ => Err(format!(
            "the proxy {} answered CONNECT with something that is not HTTP",
            proxy.at.authority()
        )),
    }
}

/// The TLS client: the platform's roots and checks (as reqwest's own), HTTP/1.1 by ALPN.
pub fn tls() -> Result<&'static tokio_rustls::TlsConnector, String> {
    static C: OnceLock<Result<tokio_rustls::TlsConnector, String>> = OnceLock::new();
    C.get_or_init(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
        use rustls_platform_verifier::ConfigVerifierExt as _;
        let mut config = rustls::ClientConfig::with_platform_verifier()
            .map_err(|e| format!("cannot load this machine's TLS roots: {e}"))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// How long an idle connection is kept for the next request to its origin.
const IDLE_FOR: Duration = Duration::from_secs(60);

type Idle = HashMap<Origin, Vec<(Conn, Instant)>>;

fn idle() -> &'static Mutex<Idle> {
    static IDLE: OnceLock<Mutex<Idle>> = OnceLock::new();
    IDLE.get_or_init(Mutex::default)
}

/// The newest idle connection to `origin` that is still fresh and quiet, if one is kept
/// (the ones looked at and found otherwise are closed; the older ones are the sweeper's).
/// Taking one looks at the newest only: ten thousand kept connections cost nothing here.
pub fn take_idle(origin: &Origin) -> Option<Conn> {
    // Connections found unusable are closed after the lock is let go.
    let mut closing = Vec::new();
    let mut idle = idle().lock().ok()?;
    let kept = idle.get_mut(origin)?;
    while let Some((mut conn, since)) = kept.pop() {
        if since.elapsed() < IDLE_FOR && conn.quiet() {
            return Some(conn);
        }
        closing.push(conn);
    }
    drop(idle);
    drop(closing);
    None
}

/// Keeps `conn` for the next request to `origin`. The first one kept starts a sweeper that
/// closes, every few seconds, the connections idle past [`IDLE_FOR`] or closed by their
/// server, whatever the traffic does after.
pub fn keep_idle(origin: &Origin, conn: Conn) {
    static SWEEPER: OnceLock<()> = OnceLock::new();
    SWEEPER.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("http-idle".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(SWEEP_EVERY);
                    sweep();
                }
            });
    });
    if let Ok(mut idle) = idle().lock() {
        idle.entry(origin.clone())
            .or_default()
            .push((conn, Instant::now()));
    }
}

/// How often the idle connections are looked over.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Closes the idle connections kept past [`IDLE_FOR`] or closed by their server.
fn sweep() {
    // Taken out under the lock, closed after it (ten thousand closes would hold up every
    // request meanwhile).
    let mut closing = Vec::new();
    if let Ok(mut idle) = idle().lock() {
        for kept in idle.values_mut() {
            let mut keep = Vec::with_capacity(kept.len());
            for (mut conn, since) in std::mem::take(kept) {
                if since.elapsed() < IDLE_FOR && conn.quiet() {
                    keep.push((conn, since));
                } else {
                    closing.push(conn);
                }
            }
            *kept = keep;
        }
        idle.retain(|_, kept| !kept.is_empty());
    }
    drop(closing);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxies(vars: &[(&str, &str)]) -> Proxies {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Proxies::from_vars(|n| vars.get(n).cloned())
    }

    fn origin(url: &str) -> Origin {
        Origin::of(&url.parse().unwrap()).unwrap()
    }

    #[test]
    fn the_environment_names_a_proxy_per_scheme_and_the_hosts_that_go_direct() {
        let p = proxies(&[
            ("http_proxy", "http://proxy.local:3128"),
            ("HTTPS_PROXY", "user:p%40ss@tunnel.local"),
            ("NO_PROXY", "localhost, .internal.example, 10.0.0.0/8,::1"),
        ]);
        let via = |u: &str| p.route(&origin(u)).unwrap().map(|p| p.at.authority());
        assert_eq!(
            via("http://api.example.com/v1"),
            Some("proxy.local:3128".into())
        );
        assert_eq!(
            via("https://api.example.com/v1"),
            Some("tunnel.local".into())
        );
        for direct in [
            "http://localhost:8080/",
            "https://a.internal.example/",
            "https://internal.example/",
            "http://10.1.2.3/",
            "http://[::1]:9000/",
        ] {
            assert_eq!(via(direct), None, "{direct}");
        }
        let tunnel = p.route(&origin("https://x.org/")).unwrap().unwrap();
        // "user:p@ss" in base64.
        assert_eq!(tunnel.auth.as_deref(), Some("Basic dXNlcjpwQHNz"));
        let all = proxies(&[("ALL_PROXY", "http://all:8080"), ("NO_PROXY", "*")]);
        assert_eq!(all.route(&origin("https://x.org/")).unwrap(), None);
        let all = proxies(&[("ALL_PROXY", "http://all:8080")]);
        assert!(all.route(&origin("https://x.org/")).unwrap().is_some());
        assert!(
            proxies(&[])
                .route(&origin("https://x.org/"))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_proxy_that_cannot_be_used_is_an_error_that_names_the_variable() {
        let p = proxies(&[("HTTPS_PROXY", "socks5://s:1080")]);
        let e = p.route(&origin("https://x.org/")).unwrap_err();
        assert!(
            e.contains("HTTPS_PROXY") && e.contains("http:// proxy"),
            "{e}"
        );
        // Not named for plain HTTP: those requests go direct.
        assert_eq!(p.route(&origin("http://x.org/")).unwrap(), None);
    }

    /// A password with a raw `/` (as people write them in HTTPS_PROXY) is the password, not
    /// the start of a path; and an error about such a URL never shows it.
    #[test]
    fn a_password_with_a_raw_slash_is_read_and_never_shown() {
        let p = proxies(&[("HTTPS_PROXY", "http://user:pa/ss@tunnel.local:3128")]);
        let tunnel = p.route(&origin("https://x.org/")).unwrap().unwrap();
        assert_eq!(tunnel.at.authority(), "tunnel.local:3128");
        // "user:pa/ss" in base64.
        assert_eq!(tunnel.auth.as_deref(), Some("Basic dXNlcjpwYS9zcw=="));
        let p = proxies(&[("HTTPS_PROXY", "http://user:pa/ss@tun nel.local:3128")]);
        let e = p.route(&origin("https://x.org/")).unwrap_err();
        assert!(!e.contains("pa/ss") && !e.contains("ss@"), "{e}");
        assert!(e.contains("tun nel.local:3128"), "{e}");
    }

    #[test]
    fn a_port_out_of_range_is_an_error_not_the_schemes_own() {
        for u in ["http://127.0.0.1:99999/", "https://api.example.com:0/"] {
            let uri: http::Uri = u.parse().expect("a URI");
            let e = Origin::of(&uri).unwrap_err();
            assert!(e.contains("is not a port"), "{u}: {e}");
        }
        let p = proxies(&[("HTTPS_PROXY", "http://proxy.local:70000")]);
        assert!(p.route(&origin("https://x.org/")).is_err());
    }
}
