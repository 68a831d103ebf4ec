//! Committing test data through the engine (feature `engine`).

use std::sync::Arc;

use cairn_engine::commit::{commit, CommitOptions, CommitResult};
use cairn_engine::source::StreamSource;
use cairn_repo::Repo;

/// Commits `data` as a new version of `image` with the default options; panics on failure.
pub async fn commit_bytes(repo: &Arc<Repo>, image: &str, data: Vec<u8>) -> CommitResult {
    let src = StreamSource::new("test", std::io::Cursor::new(data));
    commit(repo.clone(), image, Box::new(src), CommitOptions::default())
        .await
        .expect("commit the test data")
}
