//! The rules an export starts under, here so that every caller (the CLI, a library user, a
//! future server) gets the same ones: who may connect to a writable export, and how far it
//! reads ahead by default.

use cairn_repo::Repo;

/// A listening address the export may not use as asked.
#[derive(Debug, thiserror::Error)]
pub enum ListenRefused {
    /// A writable export on TCP without client certificates: anyone who reaches the address
    /// could overwrite the disk.
    #[error(
        "refusing a writable export on {addr} without TLS client certificates: {who} and \
         overwrite the disk; serve on a Unix socket (--socket PATH, private to you), require \
         client certificates (--tls-dir DIR with ca-cert.pem, or --tls-cert FILE --tls-key \
         FILE --tls-ca FILE), or pass --insecure"
    )]
    UnauthenticatedWritable { addr: String, who: &'static str },
}

/// Whether a writable export may listen on TCP address `addr`. A TCP port takes any client
/// that reaches it — on a loopback address, every local user — so a writable one must know
/// its clients: TLS with client certificates, unless `insecure`. A Unix socket is private
/// to its owner (0600 in a 0700 directory) and needs no such check.
pub async fn check_tcp_listen(
    addr: &str,
    writable: bool,
    client_certificates: bool,
    insecure: bool,
) -> Result<(), ListenRefused> {
    if !writable || client_certificates || insecure {
        return Ok(());
    }
    let who = match is_loopback(addr).await {
        Some(true) => "every local user can connect to a loopback address",
        _ => "anyone who can reach that address can connect",
    };
    Err(ListenRefused::UnauthenticatedWritable {
        addr: addr.to_string(),
        who,
    })
}

/// Whether every address `addr` resolves to is a loopback one (`None`: it does not resolve;
/// binding it will say why).
async fn is_loopback(addr: &str) -> Option<bool> {
    let addrs: Vec<_> = tokio::net::lookup_host(addr).await.ok()?.collect();
    if addrs.is_empty() {
        return None;
    }
    Some(addrs.iter().all(|a| a.ip().is_loopback()))
}

/// Leaves an export reads ahead of a sequential reader: `asked`, or by default none in
/// format 2 (a group run already brings its neighbours) and 8 in format 1.
pub fn readahead(repo: &Repo, asked: Option<usize>) -> usize {
    asked.unwrap_or(if repo.v2().is_some() { 0 } else { 8 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_an_unauthenticated_writable_tcp_export_is_refused() {
        for (writable, certs, insecure) in [
            (false, false, false),
            (true, true, false),
            (true, false, true),
        ] {
            check_tcp_listen("127.0.0.1:10809", writable, certs, insecure)
                .await
                .unwrap();
        }
        let err = check_tcp_listen("127.0.0.1:10809", true, false, false)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("every local user"), "{err}");
    }
}
