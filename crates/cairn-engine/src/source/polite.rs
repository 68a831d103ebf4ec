//! Read-rate limiting (CloudVS §3.4): a scan of a live host's disks must not starve the VMs
//! running on it of I/O bandwidth.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use cairn_image::{DiskImage, ImageResult, Layer, MapRun};

/// A [`DiskImage`] whose reads are paced to at most `bytes_per_sec` on average (across all
/// threads). Short bursts up to a tenth of a second's worth are allowed.
pub struct RateLimited<I: ?Sized> {
    bytes_per_sec: u64,
    state: Mutex<Bucket>,
    inner: Box<I>,
}

struct Bucket {
    /// When the bytes read so far will have been "paid for" at the target rate.
    paid_until: Instant,
}

impl<I: DiskImage + ?Sized> RateLimited<I> {
    pub fn new(inner: Box<I>, bytes_per_sec: u64) -> Self {
        RateLimited {
            bytes_per_sec: bytes_per_sec.max(1),
            state: Mutex::new(Bucket {
                paid_until: Instant::now(),
            }),
            inner,
        }
    }

    /// Accounts for `n` bytes and sleeps until the average rate is back under the limit.
    fn pace(&self, n: u64) {
        let cost = Duration::from_secs_f64(n as f64 / self.bytes_per_sec as f64);
        let burst = Duration::from_millis(100);
        let wake = {
            let mut b = self.state.lock().expect("rate limiter lock");
            let now = Instant::now();
            // Idle time does not accumulate credit beyond one burst.
            if b.paid_until + burst < now {
                b.paid_until = now - burst;
            }
            b.paid_until += cost;
            b.paid_until
        };
        let now = Instant::now();
        if wake > now + burst {
            std::thread::sleep(wake - now - burst);
        }
    }
}

impl<I: DiskImage + ?Sized> DiskImage for RateLimited<I> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn map(&self) -> ImageResult<Vec<MapRun>> {
        self.inner.map()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ImageResult<()> {
        self.pace(buf.len() as u64);
        self.inner.read_at(buf, offset)
    }
    fn layers(&self) -> Vec<Layer> {
        self.inner.layers()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_image::{Allocation, ImageFormat};

    struct Zeros;
    impl DiskImage for Zeros {
        fn describe(&self) -> String {
            "zeros".into()
        }
        fn size(&self) -> u64 {
            1 << 30
        }
        fn map(&self) -> ImageResult<Vec<MapRun>> {
            Ok(vec![MapRun {
                start: 0,
                len: 1 << 30,
                alloc: Allocation::Data,
                depth: 0,
            }])
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> ImageResult<()> {
            buf.fill(0);
            Ok(())
        }
        fn layers(&self) -> Vec<Layer> {
            vec![Layer {
                path: "zeros".into(),
                format: ImageFormat::Raw,
                size: 1 << 30,
            }]
        }
    }

    #[test]
    fn reads_are_paced_to_the_limit() {
        // 8 MiB at 20 MiB/s: at least 0.4 s minus the 0.1 s burst allowance.
        let img = RateLimited::new(Box::new(Zeros), 20 << 20);
        let started = Instant::now();
        let mut buf = vec![0u8; 1 << 20];
        for i in 0..8 {
            img.read_at(&mut buf, i << 20).unwrap();
        }
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(290), "took {took:?}");
    }
}
