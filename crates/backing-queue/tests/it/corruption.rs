//! Truncated and bit-flipped segment files: never a panic; a torn tail is cut
//! off, damage elsewhere is an error naming the file and offset, or is skipped.

use std::fs;
use std::path::{Path, PathBuf};

use warren_backing_queue::{BackingQueue, NewMessage, QueueConfig, StoreConfig, StoreError};

/// Writes `n` persistent messages (ids 0..n) to a log in `dir`; returns the
/// segment files, oldest first.
fn write_log(dir: &Path, n: u64, store: StoreConfig) -> Vec<PathBuf> {
    let (mut q, _) = BackingQueue::open(dir, QueueConfig::default(), store).unwrap();
    for id in 0..n {
        q.publish(0, NewMessage::new(id, vec![id as u8; 20], true))
            .unwrap();
    }
    q.sync().unwrap();
    drop(q);
    // The segments (not the log's `boot` record).
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    files.sort();
    files
}

fn ids(dir: &Path, store: StoreConfig) -> Result<Vec<u64>, StoreError> {
    let (mut q, _) = BackingQueue::open(dir, QueueConfig::default(), store)?;
    let mut out = Vec::new();
    while let Some(d) = q.fetch(0).map_err(|e| match e {
        warren_backing_queue::QueueError::Store(s) => s,
        other => panic!("{other}"),
    })? {
        assert_eq!(d.body, vec![d.id as u8; 20]);
        out.push(d.id);
    }
    Ok(out)
}

/// Cuts the file at `path` to `len` bytes, as a crash may leave it.
fn cut(path: &Path, len: u64) {
    fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

/// The segment config of the tests with several segments.
fn small_segments() -> StoreConfig {
    StoreConfig {
        segment_bytes: 400,
        ..StoreConfig::default()
    }
}

fn copy_dir(from: &Path, to: &Path) {
    for e in fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

#[test]
fn truncation_anywhere_in_the_last_segment_keeps_a_prefix() {
    let src = tempfile::tempdir().unwrap();
    let files = write_log(src.path(), 12, StoreConfig::default());
    assert_eq!(files.len(), 1);
    let len = fs::metadata(&files[0]).unwrap().len();
    let mut previous = 0;
    for cut in (0..len).step_by(3).chain([len]) {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(src.path(), dir.path());
        let f = dir.path().join(files[0].file_name().unwrap());
        self::cut(&f, cut);
        let got = ids(dir.path(), StoreConfig::default()).expect("a torn tail is not an error");
        assert_eq!(
            got,
            (0..got.len() as u64).collect::<Vec<_>>(),
            "cut at {cut}"
        );
        assert!(got.len() >= previous, "monotone in the cut");
        previous = got.len();
        // The log is usable afterwards, and the cut stays cut.
        let (mut q, report) =
            BackingQueue::open(dir.path(), QueueConfig::default(), StoreConfig::default()).unwrap();
        assert!(report.truncated.is_none());
        q.publish(0, NewMessage::new(99, vec![99; 20], true))
            .unwrap();
        q.sync().unwrap();
        drop(q);
        let again = ids(dir.path(), StoreConfig::default()).unwrap();
        assert_eq!(again.last(), Some(&99));
    }
    assert_eq!(previous, 12);
}

#[test]
fn bit_flips_are_detected_and_skippable() {
    let store = small_segments();
    let src = tempfile::tempdir().unwrap();
    let files = write_log(src.path(), 20, store);
    assert!(files.len() >= 3, "several segments");
    let all: Vec<u64> = (0..20).collect();
    for (fi, file) in files.iter().enumerate() {
        let len = fs::metadata(file).unwrap().len();
        let last_file = fi + 1 == files.len();
        for pos in (0..len).step_by(5) {
            let dir = tempfile::tempdir().unwrap();
            copy_dir(src.path(), dir.path());
            let f = dir.path().join(file.file_name().unwrap());
            let mut bytes = fs::read(&f).unwrap();
            bytes[pos as usize] ^= 0x10;
            fs::write(&f, &bytes).unwrap();
            match ids(dir.path(), store) {
                Ok(got) => {
                    // Only a flip in the last record of the last segment looks
                    // like a torn write; it costs that record alone.
                    assert!(last_file, "flip at {pos} of {} went unnoticed", f.display());
                    assert_eq!(got, all[..19].to_vec());
                }
                Err(StoreError::Corrupt {
                    file: bad, offset, ..
                }) => {
                    assert_eq!(bad, f);
                    assert!(offset <= pos, "offset {offset} after the flip at {pos}");
                }
                Err(other) => panic!("unexpected error {other}"),
            }
            let skipping = StoreConfig {
                skip_corrupt: true,
                ..store
            };
            let dir2 = tempfile::tempdir().unwrap();
            copy_dir(src.path(), dir2.path());
            fs::write(dir2.path().join(file.file_name().unwrap()), &bytes).unwrap();
            let got = ids(dir2.path(), skipping).expect("skip_corrupt recovers");
            assert!(got.windows(2).all(|w| w[0] < w[1]));
            assert!(got.len() >= 19, "flip at {pos} lost {:?}", 20 - got.len());
        }
    }
}

#[test]
fn a_torn_segment_followed_only_by_empty_ones_ends_the_log() {
    // A crash between a roll and the sealed segment's sync: the sealed one
    // torn anywhere, the ones begun after it holding no record (empty, or
    // a header only). Anything else after a tear is corruption.
    let store = small_segments();
    let src = tempfile::tempdir().unwrap();
    let files = write_log(src.path(), 20, store);
    assert!(files.len() >= 3, "several segments");
    let name = |i: usize| files[i].file_name().unwrap().to_owned();
    let (sealed, after) = (files.len() - 2, files.len() - 1);
    let sealed_len = fs::metadata(&files[sealed]).unwrap().len();
    let before: usize = ids(src.path(), store).unwrap().len();
    let in_earlier = {
        // Messages in the segments before the torn one.
        let dir = tempfile::tempdir().unwrap();
        copy_dir(src.path(), dir.path());
        fs::remove_file(dir.path().join(name(after))).unwrap();
        fs::write(dir.path().join(name(sealed)), b"").unwrap();
        ids(dir.path(), store).unwrap().len()
    };
    for header_only in [false, true] {
        for cut in (0..sealed_len).step_by(7) {
            let dir = tempfile::tempdir().unwrap();
            copy_dir(src.path(), dir.path());
            let torn = dir.path().join(name(sealed));
            self::cut(&torn, cut);
            let later = dir.path().join(name(after));
            let bytes = fs::read(&later).unwrap();
            fs::write(&later, if header_only { &bytes[..20] } else { &[][..] }).unwrap();
            let got = ids(dir.path(), store).expect("a torn sealed segment is not an error");
            assert_eq!(
                got,
                (0..got.len() as u64).collect::<Vec<_>>(),
                "cut at {cut}"
            );
            assert!(
                got.len() >= in_earlier && got.len() < before,
                "cut at {cut}: {got:?}"
            );
            // The log goes on from the tear.
            let (mut q, _) = BackingQueue::open(dir.path(), QueueConfig::default(), store).unwrap();
            q.publish(0, NewMessage::new(99, vec![99; 20], true))
                .unwrap();
            q.sync().unwrap();
            drop(q);
            assert_eq!(ids(dir.path(), store).unwrap().last(), Some(&99));
        }
    }
    // A tear followed by a segment that holds records is corruption.
    let dir = tempfile::tempdir().unwrap();
    copy_dir(src.path(), dir.path());
    let torn = dir.path().join(name(sealed));
    cut(&torn, sealed_len - 5);
    match ids(dir.path(), store) {
        Err(StoreError::Corrupt { file, .. }) => assert_eq!(file, torn),
        other => panic!("expected corruption, got {other:?}"),
    }
}
