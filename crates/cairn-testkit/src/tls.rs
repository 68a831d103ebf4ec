//! TLS certificates for tests of the NBD server and the export (feature `tls`): a CA and the
//! server and client certificates it signs, as PEM, made with rcgen.

/// A CA that signs certificates.
pub struct Ca {
    pub issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pub pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_string());
        let key = rcgen::KeyPair::generate().unwrap();
        let pem = p.self_signed(&key).unwrap().pem();
        Ca {
            issuer: rcgen::Issuer::new(p, key),
            pem,
        }
    }

    /// (certificate PEM, key PEM) for `names`, for a server or a client.
    pub fn sign(&self, names: &[&str], client: bool) -> (String, String) {
        let mut p =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, names[0].to_string());
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::DigitalSignature,
            rcgen::KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}
