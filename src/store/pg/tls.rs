//! TLS to PostgreSQL, over rustls (ring, as every other TLS of the worker), with libpq's
//! `sslmode` and `sslrootcert` URL parameters:
//!
//! | sslmode | TLS | the server's certificate |
//! | --- | --- | --- |
//! | `disable` | never | - |
//! | `allow`, `prefer` (the default) | when the server offers it | not checked (as libpq) |
//! | `require` | always | checked against `sslrootcert` when one is given, else not |
//! | `verify-ca` | always | chains to `sslrootcert` (default `~/.postgresql/root.crt`) |
//! | `verify-full` | always | as verify-ca, and names the host of the URL |
//!
//! `sslrootcert=system` trusts the operating system's roots. A server certificate that is
//! itself in `sslrootcert` (a self-signed one) is trusted as it is, as libpq trusts it.
//! `tokio-postgres` reads only
//! `disable`, `prefer` and `require`; the other modes and `sslrootcert` are taken out of the
//! URL here and mapped onto `require` with the matching certificate check. No channel binding
//! is offered (SCRAM authenticates without it, as libpq's `channel_binding=prefer` allows).

use postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::store::{Error, Result};

/// How a connection uses TLS, as the URL's `sslmode` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// What makes the TLS connections of one database URL.
#[derive(Clone)]
pub struct Connector {
    pub mode: Mode,
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// The connector for `sslmode` and `sslrootcert` (as given in the URL), and the mode
    /// `tokio-postgres` is told.
    pub fn new(
        sslmode: Option<&str>,
        sslrootcert: Option<&str>,
    ) -> Result<(Connector, postgres::config::SslMode)> {
        use postgres::config::SslMode;
        let mode = match sslmode.unwrap_or("prefer") {
            "disable" => Mode::Disable,
            "allow" | "prefer" => Mode::Prefer,
            "require" => Mode::Require,
            "verify-ca" => Mode::VerifyCa,
            "verify-full" => Mode::VerifyFull,
            other => {
                return Err(Error::Invalid(format!(
                    "sslmode={other:?} in the database URL: use disable, allow, prefer, require, verify-ca or verify-full"
                )));
            }
        };
        let roots = match (mode, sslrootcert) {
            (Mode::Disable | Mode::Prefer, _) | (Mode::Require, None) => None,
            (_, Some(path)) => Some(load_roots(path)?),
            (_, None) => {
                let default = std::env::var_os("HOME")
                    .map(|h| PathBuf::from(h).join(".postgresql/root.crt"))
                    .filter(|p| p.exists())
                    .ok_or_else(|| {
                        Error::Invalid(format!(
                            "sslmode={} needs the certificate of the authority that signed the server's: give sslrootcert=FILE (PEM) in the database URL, or sslrootcert=system",
                            sslmode.unwrap_or("")
                        ))
                    })?;
                Some(load_roots(&default.to_string_lossy())?)
            }
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Invalid(format!("TLS: {e}")))?;
        let verifier: Arc<dyn ServerCertVerifier> = match roots {
            None => Arc::new(Unchecked(provider)),
            Some(roots) => {
                let mut store = RootCertStore::empty();
                for cert in &roots {
                    store
                        .add(cert.clone())
                        .map_err(|e| Error::Invalid(format!("sslrootcert: {e}")))?;
                }
                let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
                    Arc::new(store),
                    Arc::clone(&provider),
                )
                .build()
                .map_err(|e| Error::Invalid(format!("sslrootcert: {e}")))?;
                Arc::new(Trusted {
                    webpki,
                    roots,
                    check_name: mode == Mode::VerifyFull,
                })
            }
        };
        let config = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        let told = match mode {
            Mode::Disable => SslMode::Disable,
            Mode::Prefer => SslMode::Prefer,
            _ => SslMode::Require,
        };
        Ok((
            Connector {
                mode,
                config: Arc::new(config),
            },
            told,
        ))
    }
}

/// The certificates of `path` (PEM), or the system's roots for `system`.
fn load_roots(path: &str) -> Result<Vec<CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = Vec::new();
    if path == "system" {
        roots = rustls_native_certs::load_native_certs().certs;
        if roots.is_empty() {
            return Err(Error::Invalid(
                "sslrootcert=system: no certificates were found in the system's store".into(),
            ));
        }
        return Ok(roots);
    }
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| Error::Invalid(format!("sslrootcert {path}: {e}")))?;
    for cert in certs {
        roots.push(cert.map_err(|e| Error::Invalid(format!("sslrootcert {path}: {e}")))?);
    }
    if roots.is_empty() {
        return Err(Error::Invalid(format!(
            "sslrootcert {path}: no certificate in the file (PEM expected)"
        )));
    }
    Ok(roots)
}

/// A certificate checked against `sslrootcert`: it chains to one of the roots, or is one of
/// them (a self-signed server certificate); with `verify-full` it also names the host.
#[derive(Debug)]
struct Trusted {
    webpki: Arc<rustls::client::WebPkiServerVerifier>,
    roots: Vec<CertificateDer<'static>>,
    check_name: bool,
}

impl ServerCertVerifier for Trusted {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if self.roots.iter().any(|r| r.as_ref() == end_entity.as_ref()) {
            if self.check_name {
                webpki::EndEntityCert::try_from(end_entity)
                    .and_then(|c| c.verify_is_valid_for_subject_name(server_name))
                    .map_err(|_| {
                        rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)
                    })?;
            }
            return Ok(ServerCertVerified::assertion());
        }
        match self
            .webpki
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            // verify-ca: the chain is checked, the name is not (libpq's meaning).
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(m, c, d)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(m, c, d)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// `prefer` and `require` without a root: encrypted, the certificate not checked (libpq's
/// meaning; the handshake's signatures are still verified).
#[derive(Debug)]
struct Unchecked(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

impl<S> MakeTlsConnect<S> for Connector
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = Stream<S>;
    type TlsConnect = Connect;
    type Error = std::io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> std::io::Result<Connect> {
        let name = ServerName::try_from(domain.to_string())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        Ok(Connect {
            name,
            connector: tokio_rustls::TlsConnector::from(Arc::clone(&self.config)),
        })
    }
}

/// One connection's handshake.
pub struct Connect {
    name: ServerName<'static>,
    connector: tokio_rustls::TlsConnector,
}

impl<S> TlsConnect<S> for Connect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = Stream<S>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Stream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let handshake = self.connector.connect(self.name, stream);
        Box::pin(async move { handshake.await.map(Stream) })
    }
}

/// A TLS stream to the server.
pub struct Stream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> postgres::tls::TlsStream for Stream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
