//! Encryption at rest (format 2): the repository's master key, keyed ids, sealed
//! objects and key slots. Nothing here is used by format v1; a v1 repository is plain.
//!
//! - **Master key**: 64 random bytes made at `init` — a data key (32) for the AEAD and an id
//!   key (32) for keyed BLAKE3 — never stored in the clear.
//! - **Keyed ids**: chunk and node ids are `BLAKE3-keyed(id key, plain bytes)`, so equal data
//!   dedups inside one repository and nothing can be matched against another repository or a
//!   guessed plaintext without the key.
//! - **Sealed object**: `nonce (24) | ciphertext | tag (16)`, XChaCha20-Poly1305 under the data
//!   key with a random nonce (192 bits: no nonce state shared between hosts, no reuse in
//!   practice), and the object's [`Domain`] as associated data, so an object of one kind can
//!   never be passed off as another.
//! - **Key slot**: the master key wrapped by a key-encryption key derived from a passphrase
//!   with Argon2id; several slots (one per passphrase) open the same master key.
//!
//! A wrong passphrase and a tampered object are told apart only where that is possible: a
//! slot that does not open is [`CryptoError::WrongPassphrase`] (the slot's own bytes may be
//! damaged too, which the AEAD cannot distinguish); an object that does not open under the
//! right key is [`CryptoError::Tampered`].

use argon2::{Algorithm, Argon2, Params, Version};
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use rand::RngCore;
use zeroize::{Zeroize, Zeroizing};

use crate::codec::{Decoder, Encoder};
use crate::error::{FormatError, FormatResult};
use crate::Id;

/// Bytes of the nonce in front of every sealed object.
pub const NONCE_LEN: usize = 24;
/// Bytes of the authentication tag at the end of every sealed object.
pub const TAG_LEN: usize = 16;
/// What sealing adds to an object's size.
pub const SEAL_OVERHEAD: usize = NONCE_LEN + TAG_LEN;

const KEY_LEN: usize = 32;
const MASTER_LEN: usize = 2 * KEY_LEN;
const SLOT_MAGIC: &[u8; 4] = b"CKSL";
const SLOT_VERSION: u8 = 1;
/// The slot's KDF: Argon2id, version 0x13.
const KDF_ARGON2ID: u8 = 1;
const SALT_LEN: usize = 16;

/// What kind of object is sealed: the associated data of its AEAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Domain {
    /// A compressed chunk group in a pack.
    Group = 1,
    /// A manifest node (leaf or interior).
    Node = 2,
    IndexFile = 3,
    VersionRecord = 4,
    Ref = 5,
    Summary = 6,
    /// Deletion, freed, quarantine and GC markers, sessions.
    Marker = 7,
    /// The master key inside a key slot.
    KeySlot = 8,
    /// The trailer of a v2 pack (its group and chunk table).
    PackTrailer = 9,
    /// The frame in front of a group in a version 3 pack (see `group_frame`).
    GroupFrame = 10,
    /// A VM version record (see `vm`).
    VmRecord = 11,
    /// An image's boot profile (see `boot_profile`).
    BootProfile = 12,
}

impl Domain {
    /// The associated data: a fixed prefix and the domain byte.
    fn aad(self) -> [u8; 8] {
        let mut aad = *b"cairn/2\0";
        aad[7] = self as u8;
        aad
    }
}

/// Why sealed bytes did not open.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CryptoError {
    #[error("wrong passphrase (no key slot opens with it)")]
    WrongPassphrase,
    #[error("{what}: authentication failed (tampered, corrupt, or sealed with another key)")]
    Tampered { what: &'static str },
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// The repository's secrets. Zeroed when dropped; `Debug` shows nothing of them.
#[derive(Clone)]
pub struct MasterKey {
    bytes: Zeroizing<[u8; MASTER_LEN]>,
}

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    /// A new random master key (at `init`).
    pub fn generate() -> MasterKey {
        let mut bytes = Zeroizing::new([0u8; MASTER_LEN]);
        rand::rngs::OsRng.fill_bytes(bytes.as_mut());
        MasterKey { bytes }
    }

    /// A master key from its 64 bytes (tests and golden vectors; a real key comes from
    /// [`MasterKey::generate`] or a key slot).
    pub fn from_bytes(bytes: [u8; MASTER_LEN]) -> MasterKey {
        MasterKey {
            bytes: Zeroizing::new(bytes),
        }
    }

    fn data_key(&self) -> &[u8] {
        &self.bytes[..KEY_LEN]
    }

    fn id_key(&self) -> &[u8; KEY_LEN] {
        self.bytes[KEY_LEN..].try_into().expect("32 bytes")
    }

    /// The id of `data` in this repository: keyed BLAKE3.
    pub fn id_of(&self, data: &[u8]) -> Id {
        Id(*blake3::keyed_hash(self.id_key(), data).as_bytes())
    }

    /// What the config stores to recognise this key: a keyed hash of a fixed string (says
    /// nothing of the key, and no other key gives it).
    pub fn key_check(&self) -> [u8; 32] {
        *blake3::keyed_hash(self.id_key(), b"cairn/2 key check").as_bytes()
    }

    /// The key of this repository's group ids (see [`crate::group::group_id`]): derived from
    /// the id key, so group ids, like chunk ids, match nothing outside the repository.
    pub(crate) fn group_id_key(&self) -> [u8; KEY_LEN] {
        blake3::derive_key(crate::group::GROUP_ID_CONTEXT, self.id_key())
    }

    /// Seals `plain` as an object of `domain` under a fresh random nonce.
    pub fn seal(&self, domain: Domain, plain: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        seal_with(self.data_key(), domain, &nonce, plain)
    }

    /// [`MasterKey::seal`] with a given nonce: only for golden vectors, where the bytes must
    /// be reproducible. Never reuse a nonce under one key.
    #[doc(hidden)]
    pub fn seal_with_nonce(
        &self,
        domain: Domain,
        nonce: &[u8; NONCE_LEN],
        plain: &[u8],
    ) -> Vec<u8> {
        seal_with(self.data_key(), domain, nonce, plain)
    }

    /// Opens an object sealed by [`MasterKey::seal`] as `domain`; `what` names it in errors.
    pub fn open(
        &self,
        domain: Domain,
        what: &'static str,
        sealed: &[u8],
    ) -> Result<Vec<u8>, CryptoError> {
        open_with(self.data_key(), domain, what, sealed)
    }
}

/// The plain bytes of an object stored sealed or not: opened under `key` as `domain` when
/// `sealed`, borrowed as they are otherwise. `what` names the object in errors, including the
/// one for a sealed object and no key.
pub(crate) fn open_if_sealed<'a>(
    sealed: bool,
    key: Option<&MasterKey>,
    domain: Domain,
    what: &'static str,
    stored: &'a [u8],
) -> Result<std::borrow::Cow<'a, [u8]>, CryptoError> {
    match (sealed, key) {
        (false, _) => Ok(std::borrow::Cow::Borrowed(stored)),
        (true, Some(key)) => Ok(std::borrow::Cow::Owned(key.open(domain, what, stored)?)),
        (true, None) => Err(FormatError::invalid(what, "sealed, and no key was given").into()),
    }
}

fn seal_with(key: &[u8], domain: Domain, nonce: &[u8; NONCE_LEN], plain: &[u8]) -> Vec<u8> {
    let cipher = XChaCha20Poly1305::new_from_slice(key).expect("32-byte key");
    let aad = domain.aad();
    let sealed = cipher
        .encrypt(
            XNonce::from_slice(nonce),
            Payload {
                msg: plain,
                aad: &aad,
            },
        )
        .expect("XChaCha20-Poly1305 encrypts any length a Vec holds");
    let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
    out.extend_from_slice(nonce);
    out.extend_from_slice(&sealed);
    out
}

fn open_with(
    key: &[u8],
    domain: Domain,
    what: &'static str,
    sealed: &[u8],
) -> Result<Vec<u8>, CryptoError> {
    if sealed.len() < SEAL_OVERHEAD {
        return Err(FormatError::Truncated {
            what,
            needed: SEAL_OVERHEAD as u64,
            available: sealed.len() as u64,
        }
        .into());
    }
    let (nonce, body) = sealed.split_at(NONCE_LEN);
    let cipher = XChaCha20Poly1305::new_from_slice(key).expect("32-byte key");
    let aad = domain.aad();
    cipher
        .decrypt(
            XNonce::from_slice(nonce),
            Payload {
                msg: body,
                aad: &aad,
            },
        )
        .map_err(|_| CryptoError::Tampered { what })
}

/// How hard a key slot's passphrase is to guess: Argon2id's memory (KiB), passes and lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KdfParams {
    pub memory_kib: u32,
    pub passes: u32,
    pub lanes: u8,
}

impl KdfParams {
    /// The default for new slots: 64 MiB, 3 passes, 1 lane (about a second on a slow core;
    /// above OWASP's minimum of 19 MiB and 2 passes).
    pub const DEFAULT: KdfParams = KdfParams {
        memory_kib: 64 * 1024,
        passes: 3,
        lanes: 1,
    };

    /// Limits on what a slot may ask for, so that a forged slot cannot make `open` allocate
    /// without bound: at most 4 GiB, 64 passes, 16 lanes.
    fn check(self) -> FormatResult<Params> {
        if self.memory_kib > 4 * 1024 * 1024 || self.passes > 64 || self.lanes > 16 {
            return Err(FormatError::invalid(
                "key slot",
                format!("Argon2id parameters out of range: {self:?}"),
            ));
        }
        Params::new(
            self.memory_kib,
            self.passes,
            self.lanes.into(),
            Some(KEY_LEN),
        )
        .map_err(|e| FormatError::invalid("key slot", format!("Argon2id parameters: {e}")))
    }
}

/// A master key wrapped under a passphrase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySlot {
    pub kdf: KdfParams,
    pub salt: [u8; SALT_LEN],
    /// The sealed master key (nonce, ciphertext, tag); its associated data is the slot's
    /// header, so the parameters cannot be changed without the slot failing to open.
    pub wrapped: Vec<u8>,
}

impl KeySlot {
    /// Wraps `master` under `passphrase` with a fresh salt and nonce.
    pub fn create(master: &MasterKey, passphrase: &[u8], kdf: KdfParams) -> FormatResult<KeySlot> {
        let mut salt = [0u8; SALT_LEN];
        rand::rngs::OsRng.fill_bytes(&mut salt);
        let mut nonce = [0u8; NONCE_LEN];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        Self::create_with(master, passphrase, kdf, salt, nonce)
    }

    /// [`KeySlot::create`] with a given salt and nonce: only for golden vectors.
    #[doc(hidden)]
    pub fn create_with(
        master: &MasterKey,
        passphrase: &[u8],
        kdf: KdfParams,
        salt: [u8; SALT_LEN],
        nonce: [u8; NONCE_LEN],
    ) -> FormatResult<KeySlot> {
        let kek = derive(passphrase, kdf, &salt)?;
        let header = header(kdf, &salt);
        let cipher = XChaCha20Poly1305::new_from_slice(kek.as_ref()).expect("32-byte key");
        let body = cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: master.bytes.as_ref(),
                    aad: &header,
                },
            )
            .expect("encrypting 64 bytes");
        let mut wrapped = nonce.to_vec();
        wrapped.extend_from_slice(&body);
        Ok(KeySlot { kdf, salt, wrapped })
    }

    /// The master key, if `passphrase` is this slot's.
    pub fn open(&self, passphrase: &[u8]) -> Result<MasterKey, CryptoError> {
        let kek = derive(passphrase, self.kdf, &self.salt)?;
        let header = header(self.kdf, &self.salt);
        if self.wrapped.len() != NONCE_LEN + MASTER_LEN + TAG_LEN {
            return Err(FormatError::invalid("key slot", "wrapped key of the wrong length").into());
        }
        let (nonce, body) = self.wrapped.split_at(NONCE_LEN);
        let cipher = XChaCha20Poly1305::new_from_slice(kek.as_ref()).expect("32-byte key");
        let mut plain = cipher
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: body,
                    aad: &header,
                },
            )
            .map_err(|_| CryptoError::WrongPassphrase)?;
        let mut bytes = Zeroizing::new([0u8; MASTER_LEN]);
        bytes.copy_from_slice(&plain);
        plain.zeroize();
        Ok(MasterKey { bytes })
    }

    /// `"CKSL" | version (u8) = 1 | kdf (u8) = 1 (Argon2id) | memory KiB (u32) | passes (u32)
    /// | lanes (u8) | salt (16) | nonce (24) | wrapped master key (64) | tag (16)`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = header(self.kdf, &self.salt).to_vec();
        out.extend_from_slice(&self.wrapped);
        out
    }

    pub fn decode(bytes: &[u8]) -> FormatResult<KeySlot> {
        let mut d = Decoder::new(bytes, "key slot");
        if d.take(4)? != SLOT_MAGIC {
            return Err(FormatError::BadMagic { what: "key slot" });
        }
        let version = d.u8()?;
        if version != SLOT_VERSION {
            return Err(FormatError::TooNew {
                what: "key slot",
                found: version.into(),
                supported: SLOT_VERSION.into(),
            });
        }
        let kdf_id = d.u8()?;
        if kdf_id != KDF_ARGON2ID {
            return Err(FormatError::invalid(
                "key slot",
                format!("unknown KDF {kdf_id}"),
            ));
        }
        let kdf = KdfParams {
            memory_kib: d.u32()?,
            passes: d.u32()?,
            lanes: d.u8()?,
        };
        kdf.check()?;
        let salt: [u8; SALT_LEN] = d.take(SALT_LEN)?.try_into().expect("16 bytes");
        let wrapped = d.take(NONCE_LEN + MASTER_LEN + TAG_LEN)?.to_vec();
        d.finish()?;
        Ok(KeySlot { kdf, salt, wrapped })
    }
}

/// The slot's header: everything before the nonce, authenticated with the wrapped key.
fn header(kdf: KdfParams, salt: &[u8; SALT_LEN]) -> Vec<u8> {
    let mut e = Encoder::new();
    e.bytes(SLOT_MAGIC)
        .u8(SLOT_VERSION)
        .u8(KDF_ARGON2ID)
        .u32(kdf.memory_kib)
        .u32(kdf.passes)
        .u8(kdf.lanes)
        .bytes(salt);
    e.finish()
}

/// The key-encryption key of a passphrase (Argon2id).
fn derive(
    passphrase: &[u8],
    kdf: KdfParams,
    salt: &[u8],
) -> FormatResult<Zeroizing<[u8; KEY_LEN]>> {
    let argon = Argon2::new(Algorithm::Argon2id, Version::V0x13, kdf.check()?);
    let mut kek = Zeroizing::new([0u8; KEY_LEN]);
    argon
        .hash_password_into(passphrase, salt, kek.as_mut())
        .map_err(|e| FormatError::invalid("key slot", format!("Argon2id: {e}")))?;
    Ok(kek)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small parameters: the tests are about the format, not about guessing cost.
    const FAST: KdfParams = KdfParams {
        memory_kib: 64,
        passes: 1,
        lanes: 1,
    };

    #[test]
    fn sealed_objects_open_only_as_their_domain_and_untouched() {
        let key = MasterKey::generate();
        let sealed = key.seal(Domain::Node, b"a manifest node");
        assert_eq!(sealed.len(), b"a manifest node".len() + SEAL_OVERHEAD);
        assert_eq!(
            key.open(Domain::Node, "node", &sealed).unwrap(),
            b"a manifest node"
        );
        assert_eq!(
            key.open(Domain::VersionRecord, "version", &sealed),
            Err(CryptoError::Tampered { what: "version" })
        );
        for at in [0, NONCE_LEN, sealed.len() - 1] {
            let mut bad = sealed.clone();
            bad[at] ^= 1;
            assert!(matches!(
                key.open(Domain::Node, "node", &bad),
                Err(CryptoError::Tampered { .. })
            ));
        }
        let other = MasterKey::generate();
        assert!(other.open(Domain::Node, "node", &sealed).is_err());
        assert!(matches!(
            key.open(Domain::Node, "node", &sealed[..SEAL_OVERHEAD - 1]),
            Err(CryptoError::Format(FormatError::Truncated { .. }))
        ));
        // Two seals of the same bytes differ (fresh nonces).
        assert_ne!(key.seal(Domain::Node, b"x"), key.seal(Domain::Node, b"x"));
    }

    #[test]
    fn keyed_ids_differ_between_repositories_and_from_plain_ids() {
        let (a, b) = (MasterKey::generate(), MasterKey::generate());
        assert_eq!(a.id_of(b"chunk"), a.id_of(b"chunk"));
        assert_ne!(a.id_of(b"chunk"), b.id_of(b"chunk"));
        assert_ne!(a.id_of(b"chunk"), Id::of(b"chunk"));
    }

    #[test]
    fn a_key_slot_opens_with_its_passphrase_only() {
        let key = MasterKey::generate();
        let slot = KeySlot::create(&key, b"correct horse", FAST).unwrap();
        let decoded = KeySlot::decode(&slot.encode()).unwrap();
        assert_eq!(decoded, slot);
        let opened = decoded.open(b"correct horse").unwrap();
        assert_eq!(opened.id_of(b"x"), key.id_of(b"x"));
        assert_eq!(
            decoded.open(b"wrong").unwrap_err(),
            CryptoError::WrongPassphrase
        );
        // Lowering the cost in the header makes the slot useless, not weaker.
        let mut cheaper = decoded.clone();
        cheaper.kdf.memory_kib = 32;
        assert_eq!(
            cheaper.open(b"correct horse").unwrap_err(),
            CryptoError::WrongPassphrase
        );
        assert_eq!(format!("{key:?}"), "MasterKey(..)");
    }

    #[test]
    fn a_slot_that_asks_for_too_much_memory_is_refused_before_any_work() {
        let key = MasterKey::generate();
        let mut bytes = KeySlot::create(&key, b"p", FAST).unwrap().encode();
        bytes[6..10].copy_from_slice(&u32::MAX.to_be_bytes());
        let err = KeySlot::decode(&bytes).unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
    }
}
