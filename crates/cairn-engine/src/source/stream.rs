//! A stream (stdin or a pipe): read in full, every byte, in order.

use std::io::{self, Read};
use std::path::PathBuf;

use super::{Segment, Source};
use crate::error::{EngineError, EngineResult};

/// Standard input, read so that a SIGINT or SIGTERM ends a read that is waiting for data
/// (a plain blocking read would keep a commit from a silent pipe waiting forever).
#[derive(Debug, Default)]
pub struct InterruptibleStdin;

impl Read for InterruptibleStdin {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::io::FromRawFd;
        loop {
            if crate::interrupt::requested().is_some() {
                return Err(io::Error::other("interrupted by a signal"));
            }
            let mut pfd = libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one valid pollfd for the duration of the call.
            let rc = unsafe { libc::poll(&mut pfd, 1, 200) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if rc == 0 {
                continue; // nothing yet: look at the stop request again
            }
            // SAFETY: fd 0 stays open for the life of the process; ManuallyDrop keeps this
            // File from closing it.
            let mut stdin = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(0) });
            return stdin.read(buf);
        }
    }
}

pub struct StreamSource<R: Read + Send> {
    name: String,
    reader: R,
    next_seg: u64,
    total: u64,
    done: bool,
}

impl<R: Read + Send> StreamSource<R> {
    pub fn new(name: impl Into<String>, reader: R) -> Self {
        StreamSource {
            name: name.into(),
            reader,
            next_seg: 0,
            total: 0,
            done: false,
        }
    }
}

impl<R: Read + Send> Source for StreamSource<R> {
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn size_hint(&self) -> Option<u64> {
        None
    }
    fn data_hint(&self) -> Option<u64> {
        None
    }
    fn final_size(&self) -> u64 {
        self.total
    }

    fn next_segment(
        &mut self,
        segment_size: u32,
        mut buf: Vec<u8>,
    ) -> EngineResult<Option<Segment>> {
        if self.done {
            return Ok(None);
        }
        buf.clear();
        buf.resize(segment_size as usize, 0);
        let mut filled = 0;
        while filled < buf.len() {
            match self.reader.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    crate::interrupt::check()?; // a read ended by SIGINT/SIGTERM
                    return Err(EngineError::Source {
                        op: "read error in",
                        path: PathBuf::from(&self.name),
                        source: e,
                    });
                }
            }
        }
        if filled < buf.len() {
            self.done = true;
            buf.truncate(filled);
        }
        self.total += filled as u64;
        if filled == 0 {
            return Ok(None);
        }
        let index = self.next_seg;
        self.next_seg += 1;
        Ok(Some(Segment { index, data: buf }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_source_splits_and_counts() {
        let data = vec![3u8; 2500];
        let mut src = StreamSource::new("stdin", &data[..]);
        let a = src.next_segment(1024, Vec::new()).unwrap().unwrap();
        let b = src.next_segment(1024, Vec::new()).unwrap().unwrap();
        let c = src.next_segment(1024, Vec::new()).unwrap().unwrap();
        assert!(src.next_segment(1024, Vec::new()).unwrap().is_none());
        assert_eq!(
            (a.data.len(), b.data.len(), c.data.len()),
            (1024, 1024, 452)
        );
        assert_eq!(src.final_size(), 2500);
    }
}
