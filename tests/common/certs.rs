//! Test certificates made with `openssl`: a CA and, signed by it, a server
//! certificate for 127.0.0.1 and a client certificate (P-256 keys).

use std::path::Path;

/// Runs `openssl` with `args` in `dir`.
fn openssl(dir: &Path, args: &[&str]) {
    let status = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl is installed");
    assert!(status.success(), "openssl {args:?}");
}

/// A CA and, signed by it, a certificate for `name` (`server` for
/// 127.0.0.1, or `client`), P-256 keys, in `dir`: `ca.pem`, `<name>.pem`,
/// `<name>.key`.
pub fn certificates(dir: &Path) {
    let curve = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509", "-days", "1", "-subj", "/CN=test CA"];
    ca.extend(curve);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    openssl(dir, &ca);
    for (name, ext) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
        let (key, csr, pem, ext) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
            format!("{name}.ext"),
        );
        let mut req = vec!["req", "-subj", "/CN=127.0.0.1"];
        req.extend(curve);
        req.extend(["-keyout", &key, "-out", &csr]);
        openssl(dir, &req);
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-days",
                "1",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-extfile",
                &ext,
                "-out",
                &pem,
            ],
        );
    }
}
