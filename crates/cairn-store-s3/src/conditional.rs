//! The one-time check that the server honours conditional writes, and how it wants `If-Match`.

use cairn_store::{ObjectStore as _, StoreError, StoreResult, TEMP_PREFIX};
use object_store::{
    ObjectStore as _, ObjectStoreExt as _, PutMode, PutOptions, PutPayload, UpdateVersion,
};

use crate::error_text::one_line;
use crate::S3Store;

/// How the server wants the ETag in `If-Match` on PUT (found by the conditional-write probe).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IfMatchStyle {
    /// As the server sent it, quoted (RFC 9110; MinIO, AWS).
    Quoted,
    /// Without the quotes: Ceph RGW (16.2 at least) compares the header byte for byte with the
    /// bare MD5 it stores, so a quoted ETag never matches.
    Bare,
}

impl IfMatchStyle {
    pub(crate) fn update(self, etag: &str) -> PutMode {
        let e_tag = match self {
            IfMatchStyle::Quoted => etag.to_owned(),
            IfMatchStyle::Bare => etag.trim_matches('"').to_owned(),
        };
        PutMode::Update(UpdateVersion {
            e_tag: Some(e_tag),
            version: None,
        })
    }
}

impl S3Store {
    /// Fail (every time, with the same reason) if the server does not honour conditional
    /// writes; checked once per store, before the first write.
    pub(crate) async fn require_conditional_writes(&self) -> StoreResult<IfMatchStyle> {
        let result = self
            .inner
            .conditional
            .get_or_init(|| async { self.probe_conditional_writes().await })
            .await;
        result.clone().map_err(|reason| StoreError::Remote {
            op: "check conditional writes at",
            location: self.describe(),
            reason,
        })
    }

    async fn probe_conditional_writes(&self) -> Result<IfMatchStyle, String> {
        let name = format!(
            "{TEMP_PREFIX}cas-probe-{}",
            hex::encode(rand::random::<[u8; 8]>())
        );
        let path = self.path(&name);
        let put = |data: &'static [u8], mode: PutMode| {
            let path = path.clone();
            async move {
                let _permit = self.permit().await;
                let opts = PutOptions {
                    mode,
                    ..PutOptions::default()
                };
                self.inner
                    .client
                    .put_opts(&path, PutPayload::from_static(data), opts)
                    .await
            }
        };
        let reason = |e: object_store::Error| one_line(&e.to_string(), &self.inner.secrets);
        let created = put(b"probe", PutMode::Create).await.map_err(reason)?;
        let verdict = async {
            match put(b"again", PutMode::Create).await {
                Err(object_store::Error::AlreadyExists { .. }) => {}
                Ok(_) => {
                    return Err("the server ignores If-None-Match on PUT (a second create \
                                succeeded); refusing to write, since compare-and-swap would \
                                lose updates"
                        .to_owned())
                }
                Err(e) => return Err(reason(e)),
            }
            let stale = UpdateVersion {
                e_tag: Some(format!("\"{}\"", "0".repeat(32))),
                version: None,
            };
            match put(b"stale", PutMode::Update(stale)).await {
                Err(object_store::Error::Precondition { .. }) => {}
                Ok(_) => {
                    return Err(
                        "the server ignores If-Match on PUT (a write with a wrong ETag \
                                succeeded); refusing to write, since compare-and-swap would \
                                lose updates"
                            .to_owned(),
                    )
                }
                Err(e) => return Err(reason(e)),
            }
            // A write on the right ETag must succeed, quoted as the server sent it or bare.
            let etag = created
                .e_tag
                .ok_or("the server sent no ETag, which compare-and-swap needs")?;
            for style in [IfMatchStyle::Quoted, IfMatchStyle::Bare] {
                match put(b"update", style.update(&etag)).await {
                    Ok(_) => return Ok(style),
                    Err(object_store::Error::Precondition { .. }) => {}
                    Err(e) => return Err(reason(e)),
                }
            }
            Err(format!(
                "the server refuses If-Match on PUT with the object's own ETag {etag}, quoted or \
                 not; compare-and-swap cannot work"
            ))
        }
        .await;
        let _permit = self.permit().await;
        if let Err(e) = self.inner.client.delete(&path).await {
            tracing::warn!("removing the conditional-write probe: {}", reason(e));
        }
        if let Err(why) = &verdict {
            tracing::error!("{}: {why}", self.describe());
        }
        verdict
    }
}
