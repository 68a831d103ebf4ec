//! Exports over TLS (NBD STARTTLS with rustls), tested with qemu-img, nbdcopy and nbdinfo.

use crate::common;
use crate::common::export::*;

use std::path::Path;
use std::process::Command;

#[test]
fn tls_exports_serve_qemu_img_and_nbdcopy_bit_exact() {
    let (dir, repo, a, _) = setup();
    let d = dir.path();
    let p = pki(d);
    // On a Unix socket, credentials in QEMU's layout (client certificates required).
    let served = serve_tls_on_unix(&repo, d, &p);
    let uri = served.ready["uri"].as_str().unwrap().to_string();
    assert_eq!(
        uri,
        format!("nbds+unix:///disk?socket={}", served.socket.display())
    );
    assert_eq!(served.ready["tls"], true);
    let copy = d.join("copy.raw");
    nbdcopy(
        format!("{uri}&tls-certificates={}", p.client.display()),
        &copy,
    );
    same_file(&copy, &a, "nbdcopy over TLS");

    // On TCP with --tls-cert/--tls-key (no client certificate asked), read by QEMU.
    let tcp = serve_tls_on_tcp(&repo, d, &p);
    let listen = tcp.ready["listen"].as_str().unwrap();
    assert_eq!(tcp.ready["uri"], format!("nbds://{listen}/tcp"));
    let port = listen.rsplit_once(':').unwrap().1;
    let out = d.join("qemu.raw");
    let r = qemu_img_tls(port, "tcp", &p.ca_only, &out);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    same_file(&out, &a, "qemu-img over TLS");
}

#[test]
fn tls_refuses_plaintext_clients_and_untrusted_certificates() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let p = pki(d);
    let served = serve_tls_on_unix(&repo, d, &p);
    let sock = served.socket.display().to_string();
    let tls_uri = |creds: &Path| {
        format!(
            "nbds+unix:///disk?socket={sock}&tls-certificates={}",
            creds.display()
        )
    };
    let failure = |out: std::process::Output| {
        assert!(!out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    // A plaintext client is told TLS is required.
    let err = failure(nbdinfo_size(&format!("nbd+unix:///disk?socket={sock}")));
    assert!(err.contains("TLS"), "{err}");
    // A client that trusts another CA refuses the server; the server refuses a client
    // without a certificate of its CA.
    failure(nbdinfo_size(&tls_uri(&p.stranger)));
    failure(nbdinfo_size(&tls_uri(&p.ca_only)));
    // The right credentials get in.
    let ok = nbdinfo_size(&tls_uri(&p.client));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    // QEMU trusting another CA does not read an export over TCP either.
    let tcp = serve_tls_on_tcp(&repo, d, &p);
    let listen = tcp.ready["listen"].as_str().unwrap();
    let port = listen.rsplit_once(':').unwrap().1;
    let out = d.join("never.raw");
    let r = qemu_img_tls(port, "tcp", &p.stranger, &out);
    assert!(!r.status.success());
    // A plaintext QEMU is refused too.
    let r = tool("qemu-img", "qemu-utils")
        .args(["info", &format!("nbd://{listen}/tcp")])
        .output()
        .unwrap();
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("TLS"), "{r:?}");
}

#[test]
fn bad_tls_files_are_named_in_one_line() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let p = pki(d);
    let missing = d.join("missing.pem");
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["export", "vm", "--tls-cert"])
        .arg(&p.cert)
        .arg("--tls-key")
        .arg(&missing)
        .env("CAIRN_RUN_DIR", d.join("run"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line = common::stderr_line(&out);
    assert!(
        line.starts_with(&format!(
            "cairn: error: TLS private key {}: ",
            missing.display()
        )),
        "{line}"
    );
}

/// `vm@1` as export "tcp" on 127.0.0.1 (any port) with the test PKI's server certificate and
/// key (no client certificate asked).
/// vm@1 as `disk` on a Unix socket, with credentials in QEMU's layout (client certificates
/// required).
fn serve_tls_on_unix(repo: &Path, d: &Path, p: &Pki) -> Served {
    Served::spawn(
        repo,
        d,
        "tls",
        &[
            "vm@1",
            "--name",
            "disk",
            "--tls-dir",
            p.server.to_str().unwrap(),
        ],
    )
}

fn serve_tls_on_tcp(repo: &Path, d: &Path, p: &Pki) -> Served {
    Served::spawn(
        repo,
        d,
        "tcp",
        &[
            "vm@1",
            "--name",
            "tcp",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            p.cert.to_str().unwrap(),
            "--tls-key",
            p.key.to_str().unwrap(),
        ],
    )
}
