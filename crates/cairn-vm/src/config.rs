//! A VM's recorded configuration, made to run on restored disks: the QEMU command line with
//! each backed-up disk's file replaced by its restored copy.
//!
//! Only `-drive` options are rewritten (`id=DISK`: `file=` and `format=` replaced), the form
//! a hand-started QEMU uses; a disk given another way (`-blockdev`, as libvirt writes) is left
//! as it is and named in the notes, for the operator to change.

/// A restored disk: its name in the VM, where it was written and in which format.
#[derive(Debug, Clone)]
pub struct RestoredDisk {
    pub name: String,
    pub path: std::path::PathBuf,
    /// `raw` or `qcow2`.
    pub format: String,
}

/// The arguments of `config` (one a line) with the disks' files replaced, and a note for
/// every disk that could not be.
pub fn qemu_args_on(config: &str, disks: &[RestoredDisk]) -> (Vec<String>, Vec<String>) {
    let mut args: Vec<String> = config.lines().map(str::to_string).collect();
    let mut done = vec![false; disks.len()];
    for i in 1..args.len() {
        if args[i - 1] != "-drive" {
            continue;
        }
        let opts = split_options(&args[i]);
        let id = opts.iter().find_map(|o| o.strip_prefix("id="));
        let Some(k) = id.and_then(|id| disks.iter().position(|d| d.name == id)) else {
            continue;
        };
        let disk = &disks[k];
        let mut out: Vec<String> = opts
            .iter()
            .filter(|o| !o.starts_with("file=") && !o.starts_with("format="))
            .map(|o| o.to_string())
            .collect();
        out.push(format!(
            "file={}",
            disk.path.display().to_string().replace(',', ",,")
        ));
        out.push(format!("format={}", disk.format));
        args[i] = out.join(",");
        done[k] = true;
    }
    let notes = disks
        .iter()
        .zip(done)
        .filter(|(_, done)| !done)
        .map(|(d, _)| {
            format!(
                "disk {}: no `-drive id={}` on the recorded command line: point its option at {} \
                 by hand",
                d.name,
                d.name,
                d.path.display()
            )
        })
        .collect();
    (args, notes)
}

/// `args` made to resume from the migration stream at `state` (`-incoming`), or to boot
/// afresh when `state` is `None`: any `-incoming` the recorded command line had (a VM resumed
/// once before) goes.
pub fn with_incoming(args: Vec<String>, state: Option<&std::path::Path>) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len() + 2);
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        if a == "-incoming" || a == "--incoming" {
            skip = true;
            continue;
        }
        out.push(a);
    }
    if let Some(state) = state {
        // QEMU runs the command after exec: with /bin/sh: the path is quoted for it.
        let path = state.display().to_string().replace('\'', r"'\''");
        out.push("-incoming".into());
        out.push(format!("exec:cat '{path}'"));
    }
    out
}

/// QEMU's option string split at single commas (`,,` is a literal comma and stays inside).
fn split_options(s: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                out.last_mut().expect("one part").push_str(",,");
            } else {
                out.push(String::new());
            }
        } else {
            out.last_mut().expect("one part").push(c);
        }
    }
    out
}

/// The arguments as one shell command line (each quoted where the shell would split it).
pub fn shell_line(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:@%+".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drives_get_the_restored_files() {
        let config = "qemu-system-x86_64\n-m\n1024\n-drive\nif=virtio,id=disk0,file=/vm/a,,b.qcow2,format=qcow2,cache=none\n-blockdev\n{\"node-name\":\"x\"}";
        let disks = [
            RestoredDisk {
                name: "disk0".into(),
                path: "/r/disk0.raw".into(),
                format: "raw".into(),
            },
            RestoredDisk {
                name: "data".into(),
                path: "/r/data.raw".into(),
                format: "raw".into(),
            },
        ];
        let (args, notes) = qemu_args_on(config, &disks);
        assert_eq!(
            args[4],
            "if=virtio,id=disk0,cache=none,file=/r/disk0.raw,format=raw"
        );
        assert_eq!(args[6], "{\"node-name\":\"x\"}");
        assert_eq!(notes.len(), 1);
        assert!(notes[0].starts_with("disk data:"));
        assert_eq!(shell_line(&args[..3]), "qemu-system-x86_64 -m 1024");
        assert_eq!(
            shell_line(&["a b".into(), "it's".into()]),
            r"'a b' 'it'\''s'"
        );
    }

    #[test]
    fn incoming_replaces_an_older_one() {
        let args: Vec<String> = ["qemu", "-incoming", "exec:cat old", "-m", "1"]
            .map(String::from)
            .into();
        let state = std::path::Path::new("/r/it's.state");
        assert_eq!(
            with_incoming(args.clone(), Some(state)),
            [
                "qemu",
                "-m",
                "1",
                "-incoming",
                r"exec:cat '/r/it'\''s.state'"
            ]
        );
        assert_eq!(with_incoming(args, None), ["qemu", "-m", "1"]);
    }
}
