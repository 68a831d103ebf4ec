//! A VM's recorded configuration, made to run on restored disks: the QEMU command line with
//! each backed-up disk's file replaced by its restored copy (and `-incoming` when a memory
//! state resumes it), or the libvirt domain XML renamed, without its uuid, its disks pointed
//! at the restored files.
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
    let notes = not_pointed(disks, &done, |d| {
        format!("no `-drive id={d}` on the recorded command line: point its option")
    });
    (args, notes)
}

/// A note for every restored disk the configuration could not be pointed at: `why(name)`
/// says what is missing and what to do, and the note adds where the copy is.
fn not_pointed(disks: &[RestoredDisk], done: &[bool], why: impl Fn(&str) -> String) -> Vec<String> {
    disks
        .iter()
        .zip(done)
        .filter(|(_, done)| !**done)
        .map(|(d, _)| {
            format!(
                "disk {}: {} at {} by hand",
                d.name,
                why(&d.name),
                d.path.display()
            )
        })
        .collect()
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

/// A libvirt domain XML made to define the VM again on restored disks: named `name`, its
/// `<uuid>` dropped (libvirt gives a new one: the original domain stays as it is), and each
/// backed-up disk (`<target dev=DISK>`) made a file disk of its restored copy — `<source
/// file=…>`, `<driver type=…>`, no `<backingStore>`. Disks not restored (CD-ROMs, read-only
/// ones) are left as they are. Returns the XML and a note for every restored disk the XML
/// does not have.
pub fn domain_xml_on(
    xml: &str,
    name: &str,
    disks: &[RestoredDisk],
) -> Result<(String, Vec<String>), String> {
    use quick_xml::events::{BytesText, Event};
    let mut reader = quick_xml::Reader::from_str(xml);
    let mut writer = quick_xml::Writer::new(Vec::new());
    let mut stack: Vec<Vec<u8>> = Vec::new();
    let mut disk: Option<Vec<Event<'static>>> = None;
    let mut skip_depth: Option<usize> = None;
    let mut done = vec![false; disks.len()];
    let put = |writer: &mut quick_xml::Writer<Vec<u8>>, e: Event<'_>| {
        writer.write_event(e).map_err(|e| e.to_string())
    };
    loop {
        let event = reader.read_event().map_err(|e| e.to_string())?;
        if matches!(event, Event::Eof) {
            break;
        }
        let depth = stack.len();
        let closes = match &event {
            Event::Start(e) => {
                stack.push(e.name().as_ref().to_vec());
                false
            }
            Event::End(_) => {
                stack.pop();
                true
            }
            _ => false,
        };
        // Inside a skipped element (<uuid>): drop everything up to its end.
        if let Some(d) = skip_depth {
            if closes && stack.len() == d {
                skip_depth = None;
            }
            continue;
        }
        match &event {
            Event::Start(e) if depth == 1 && e.name().as_ref() == b"uuid" => {
                skip_depth = Some(depth);
                continue;
            }
            Event::Empty(e) if depth == 1 && e.name().as_ref() == b"uuid" => continue,
            Event::Text(_) if stack.len() == 2 && stack[1] == b"name" => {
                put(&mut writer, Event::Text(BytesText::new(name)))?;
                continue;
            }
            _ => {}
        }
        // A <disk>: buffered whole, then written as it was or rewritten.
        if let Some(buf) = disk.as_mut() {
            buf.push(event.into_owned());
            if closes && stack.len() == 2 {
                let events = disk.take().expect("a disk");
                let out = rewrite_disk(events, disks, &mut done);
                for e in out {
                    put(&mut writer, e)?;
                }
            }
            continue;
        }
        if let Event::Start(e) = &event {
            if e.name().as_ref() == b"disk" && stack.len() == 3 && stack[1] == b"devices" {
                disk = Some(vec![event.into_owned()]);
                continue;
            }
        }
        put(&mut writer, event)?;
    }
    let notes = not_pointed(disks, &done, |d| {
        format!("the domain XML has no disk with target {d}: attach it")
    });
    String::from_utf8(writer.into_inner())
        .map(|x| (x, notes))
        .map_err(|e| e.to_string())
}

/// One `<disk>` element's events, rewritten onto its restored copy when it is one of `disks`.
fn rewrite_disk(
    events: Vec<quick_xml::events::Event<'static>>,
    disks: &[RestoredDisk],
    done: &mut [bool],
) -> Vec<quick_xml::events::Event<'static>> {
    use quick_xml::events::{BytesStart, Event};
    let attr = |e: &BytesStart, name: &str| -> Option<String> {
        e.try_get_attribute(name).ok().flatten().and_then(|a| {
            a.normalized_value(quick_xml::XmlVersion::default())
                .ok()
                .map(|v| v.into_owned())
        })
    };
    // The disk's target, at depth 1 inside it.
    let mut depth = 0usize;
    let mut target = None;
    for e in &events[1..] {
        match e {
            Event::Start(s) | Event::Empty(s) if depth == 0 && s.name().as_ref() == b"target" => {
                target = attr(s, "dev");
            }
            _ => {}
        }
        match e {
            Event::Start(_) => depth += 1,
            Event::End(_) => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    let Some(k) = target.and_then(|t| disks.iter().position(|d| d.name == t)) else {
        return events;
    };
    done[k] = true;
    let restored = &disks[k];
    let path = restored.path.display().to_string();
    let with = |s: &BytesStart, set: &[(&str, &str)]| -> BytesStart<'static> {
        let mut out = BytesStart::new(String::from_utf8_lossy(s.name().as_ref()).into_owned());
        for a in s.attributes().flatten() {
            let key = String::from_utf8_lossy(a.key.as_ref()).into_owned();
            if set.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let value = a
                .normalized_value(quick_xml::XmlVersion::default())
                .map(|v| v.into_owned())
                .unwrap_or_default();
            out.push_attribute((key.as_str(), value.as_str()));
        }
        for (k, v) in set {
            out.push_attribute((*k, *v));
        }
        out
    };
    let mut out = Vec::with_capacity(events.len() + 1);
    let mut depth = 0usize;
    let mut skip: Option<usize> = None;
    let mut has_driver = false;
    let last = events.len() - 1;
    for (i, e) in events.into_iter().enumerate() {
        if i == 0 {
            if let Event::Start(s) = &e {
                out.push(Event::Start(with(s, &[("type", "file")])));
            }
            continue;
        }
        if let Some(d) = skip {
            match &e {
                Event::Start(_) => depth += 1,
                Event::End(_) => {
                    depth -= 1;
                    if depth == d {
                        skip = None;
                    }
                }
                _ => {}
            }
            continue;
        }
        if i == last && !has_driver {
            out.push(Event::Empty({
                let mut d = BytesStart::new("driver");
                d.push_attribute(("name", "qemu"));
                d.push_attribute(("type", restored.format.as_str()));
                d
            }));
        }
        let at_top = depth == 0;
        match &e {
            Event::Start(s) | Event::Empty(s) if at_top => {
                let name = s.name().as_ref().to_vec();
                let rewritten = match name.as_slice() {
                    // Only the file: a block device's or a network disk's other attributes
                    // (dev, protocol, pool) would contradict it.
                    b"source" => Some({
                        let mut src = BytesStart::new("source");
                        src.push_attribute(("file", path.as_str()));
                        src
                    }),
                    b"driver" => {
                        has_driver = true;
                        Some(with(s, &[("type", restored.format.as_str())]))
                    }
                    b"backingStore" => {
                        if matches!(e, Event::Start(_)) {
                            skip = Some(depth);
                            depth += 1;
                        }
                        continue;
                    }
                    _ => None,
                };
                let opens = matches!(e, Event::Start(_));
                match (rewritten, opens) {
                    (Some(r), true) => out.push(Event::Start(r)),
                    (Some(r), false) => out.push(Event::Empty(r)),
                    (None, _) => out.push(e),
                }
                if opens {
                    depth += 1;
                }
            }
            Event::Start(_) => {
                depth += 1;
                out.push(e);
            }
            Event::End(_) => {
                depth = depth.saturating_sub(1);
                out.push(e);
            }
            _ => out.push(e),
        }
    }
    out
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
    fn a_domain_xml_points_at_the_restored_disks() {
        let xml = "<domain type='kvm'><name>web</name><uuid>1-2</uuid><devices>\
            <disk type='block' device='disk'><driver name='qemu' type='qcow2' cache='none'/>\
            <source dev='/dev/vg/web'/><backingStore type='file'><source file='/b'/>\
            </backingStore><target dev='vda' bus='virtio'/></disk>\
            <disk type='file' device='cdrom'><source file='/iso'/><target dev='sda'/><readonly/></disk>\
            <disk type='file' device='disk'><source file='/d.raw'/><target dev='vdb'/></disk>\
            </devices></domain>";
        let disks = [
            RestoredDisk {
                name: "vda".into(),
                path: "/r/vda.qcow2".into(),
                format: "qcow2".into(),
            },
            RestoredDisk {
                name: "vdb".into(),
                path: "/r/vdb.raw".into(),
                format: "raw".into(),
            },
            RestoredDisk {
                name: "vdz".into(),
                path: "/r/vdz.raw".into(),
                format: "raw".into(),
            },
        ];
        let (out, notes) = domain_xml_on(xml, "web-restored", &disks).unwrap();
        assert_eq!(
            out,
            "<domain type='kvm'><name>web-restored</name><devices>\
            <disk device=\"disk\" type=\"file\"><driver name=\"qemu\" cache=\"none\" type=\"qcow2\"/>\
            <source file=\"/r/vda.qcow2\"/><target dev='vda' bus='virtio'/></disk>\
            <disk type='file' device='cdrom'><source file='/iso'/><target dev='sda'/><readonly/></disk>\
            <disk device=\"disk\" type=\"file\"><source file=\"/r/vdb.raw\"/><target dev='vdb'/>\
            <driver name=\"qemu\" type=\"raw\"/></disk>\
            </devices></domain>"
        );
        assert_eq!(notes.len(), 1);
        assert!(notes[0].starts_with("disk vdz:"));
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
