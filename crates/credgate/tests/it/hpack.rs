//! credgate's HPACK, which the `:authority` rewriter decodes clients' blocks with and encodes
//! them again with, judged by Go's (`golang.org/x/net/http2/hpack`, the one grpc-go and the
//! kubelet use) instead of by itself: every one of the 257 Huffman codes, the refusals of
//! malformed Huffman strings, and the rewriter's output read back with its never-indexed marks.

use std::io::Write;
use std::process::{Command, Stdio};

use credgate_api::authority::{Rewriter, AUTHORITY};
use credgate_api::frame::{self, Head};
use credgate_api::hpack::HpackDecoder;

use crate::support::foreign::build_go_program;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A block of one literal field (not indexed, a new name `x`) whose value is the Huffman
/// string `code`.
fn huffman_field(code: &[u8]) -> Vec<u8> {
    let mut block = vec![0x00, 0x01, b'x'];
    assert!(code.len() < 127);
    block.push(0x80 | code.len() as u8);
    block.extend_from_slice(code);
    block
}

/// One field as Go decoded it.
#[derive(Debug, Clone, PartialEq)]
struct GoField {
    name: Vec<u8>,
    value: Vec<u8>,
    sensitive: bool,
}

/// Decodes `blocks` in order with one Go decoder: each block's fields, or its error.
fn go_decode(go: &std::path::Path, blocks: &[Vec<u8>]) -> Vec<Result<Vec<GoField>, String>> {
    let mut child = Command::new(go)
        .arg("decode")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    for block in blocks {
        writeln!(stdin, "{}", hex(block)).unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let mut answers = Vec::new();
    let mut fields = Vec::new();
    for line in text.lines() {
        if let Some(e) = line.strip_prefix("error: ") {
            answers.push(Err(e.to_owned()));
        } else if line.is_empty() {
            answers.push(Ok(std::mem::take(&mut fields)));
        } else {
            let parts: Vec<&str> = line.split(' ').collect();
            fields.push(GoField {
                name: unhex(parts[0]),
                value: unhex(parts[1]),
                sensitive: parts[2] == "true",
            });
        }
    }
    assert_eq!(answers.len(), blocks.len());
    answers
}

#[test]
fn every_huffman_code_go_writes_decodes_to_its_byte() {
    let go = build_go_program("hpackcheck");
    let out = Command::new(&go).arg("huffman").output().unwrap();
    assert!(out.status.success());
    let lines: Vec<Vec<u8>> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(unhex)
        .collect();
    assert_eq!(lines.len(), 257);
    for (byte, code) in lines[..256].iter().enumerate() {
        let mut got = Vec::new();
        HpackDecoder::new(4096)
            .decode(&huffman_field(code), |_, v| got.push(v.to_vec()))
            .unwrap_or_else(|e| panic!("byte {byte}: {e}"));
        assert_eq!(got, vec![vec![byte as u8]], "byte {byte}");
    }
    // All 256 in a row: one string whose length needs a multi-byte integer.
    let all = &lines[256];
    let mut block = vec![0x00, 0x01, b'x', 0x80 | 0x7f];
    let mut rest = all.len() - 127;
    while rest >= 128 {
        block.push(0x80 | (rest % 128) as u8);
        rest /= 128;
    }
    block.push(rest as u8);
    block.extend_from_slice(all);
    let mut got = Vec::new();
    HpackDecoder::new(4096)
        .decode(&block, |_, v| got.push(v.to_vec()))
        .unwrap();
    assert_eq!(got, vec![(0..=255).collect::<Vec<u8>>()]);
}

/// The 257th code, end-of-string, must not appear in a string (RFC 7541 §5.2), and padding is
/// at most 7 bits, all ones: credgate refuses what Go refuses, and reads what Go reads.
#[test]
fn malformed_huffman_strings_are_refused_by_both() {
    let go = build_go_program("hpackcheck");
    let cases: [(&[u8], bool); 6] = [
        (&[0xff, 0xff, 0xff, 0xfc], false), // end-of-string, then 2 bits of padding
        (&[0xff, 0xff, 0xff, 0xff], false), // end-of-string and more
        (&[0x00], false),                   // "0" padded with zeros
        (&[0x07], true),                    // "0" padded with ones
        (&[0x07, 0xff], false),             // padding of 11 bits
        (&[0x00, 0xff], true),              // "0a" padded with ones
    ];
    let blocks: Vec<Vec<u8>> = cases.iter().map(|(c, _)| huffman_field(c)).collect();
    let go_answers = go_decode(&go, &blocks);
    for (((code, _), block), go_answer) in cases.iter().zip(&blocks).zip(&go_answers) {
        let mut ours = Vec::new();
        let decoded = HpackDecoder::new(4096).decode(block, |_, v| ours.push(v.to_vec()));
        match go_answer {
            Ok(fields) => {
                assert!(
                    decoded.is_ok(),
                    "{code:02x?}: Go reads it, credgate refuses"
                );
                let theirs: Vec<Vec<u8>> = fields.iter().map(|f| f.value.clone()).collect();
                assert_eq!(ours, theirs, "{code:02x?}");
            }
            Err(e) => assert!(decoded.is_err(), "{code:02x?}: Go refuses it ({e})"),
        }
    }
    let verdicts: Vec<bool> = go_answers.iter().map(Result::is_ok).collect();
    let expected: Vec<bool> = cases.iter().map(|(_, ok)| *ok).collect();
    assert_eq!(verdicts, expected, "the cases mean what they say");
}

/// Client blocks that index, Huffman-code and mark fields never-indexed (RFC 7541 C.4's
/// requests, then one with a sensitive field and a socket-path authority) pass through the
/// rewriter; Go reads the blocks it passes on as credgate read the originals, `:authority`
/// aside, with every never-indexed field still marked.
#[test]
fn go_reads_what_the_rewriter_passes_on() {
    let go = build_go_program("hpackcheck");
    let mut sensitive = vec![0x10, 0x0d];
    sensitive.extend_from_slice(b"authorization");
    sensitive.push(0x0c);
    sensitive.extend_from_slice(b"Basic secret");
    let mut path_authority = vec![0x41, 0x17]; // :authority, incremental indexing
    path_authority.extend_from_slice(b"/run/credgate/cri.sock!");
    let client_blocks: Vec<Vec<u8>> = [
        "828684418cf1e3c2e5f23a6ba0ab90f4ff",
        "828684be5886a8eb10649cbf",
        "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf",
    ]
    .iter()
    .map(|h| unhex(h))
    .chain([
        [&[0x82, 0x84][..], &path_authority, &sensitive].concat(),
        [&[0x82, 0x84, 0xbe][..], &sensitive].concat(),
    ])
    .collect();
    // What credgate reads of the originals, with the never-indexed marks.
    let mut decoder = HpackDecoder::new(4096);
    let mut expected = Vec::new();
    for block in &client_blocks {
        let mut fields = Vec::new();
        decoder
            .decode_fields(block, |n, v, never| {
                let value = if n == b":authority" { AUTHORITY } else { v };
                fields.push(GoField {
                    name: n.to_vec(),
                    value: value.to_vec(),
                    sensitive: never,
                });
            })
            .unwrap();
        expected.push(fields);
    }
    assert!(expected[3].iter().any(|f| f.sensitive));
    let mut input = frame::PREFACE.to_vec();
    for (i, block) in client_blocks.iter().enumerate() {
        let stream = 2 * i as u32 + 1;
        frame::put(
            &mut input,
            frame::HEADERS,
            frame::END_HEADERS,
            stream,
            block,
        );
    }
    let mut out = Vec::new();
    Rewriter::new(1 << 16).feed(&input, &mut out).unwrap();
    let mut passed = Vec::new();
    let mut rest = &out[frame::PREFACE.len()..];
    while let Some(head) = Head::peek(rest) {
        assert_eq!(head.kind, frame::HEADERS);
        passed.push(rest[frame::HEAD_LEN..frame::HEAD_LEN + head.len].to_vec());
        rest = &rest[frame::HEAD_LEN + head.len..];
    }
    let theirs: Vec<Vec<GoField>> = go_decode(&go, &passed)
        .into_iter()
        .map(|a| a.expect("Go decodes every block the rewriter passes on"))
        .collect();
    assert_eq!(theirs, expected);
}
