#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/): a few valid inputs each, in the input
layout each target's comment describes. Rerun after changing a format; the files are committed."""
import json
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(here, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- tcp_frame: u8 config, per recv u8 tag + u16 size, then frames (transport/tcp/detail/wire.hpp) ----
def frame(tag, seq, total, offset, payload):
    return struct.pack("<IIQQQQ", 0x31464B53, len(payload), tag, seq, total, offset) + payload


def recvs(*rs):
    return b"".join(struct.pack("<BH", tag, size) for tag, size in rs)


write("tcp_frame", "one_message_to_posted_recv", bytes([1]) + recvs((0, 16)) + frame(0, 0, 16, 0, b"A" * 16))
write("tcp_frame", "unexpected_then_posted",
      bytes([2]) + recvs((1, 8), (2, 100)) + frame(3, 0, 8, 0, b"x" * 8) + frame(1, 1, 8, 0, b"y" * 8) +
      frame(2, 2, 100, 0, b"z" * 60) + frame(2, 2, 100, 60, b"w" * 40))
write("tcp_frame", "budgeted_empty_and_split",
      bytes([4 | 3]) + recvs((0, 0), (1, 5000), (3, 4)) + frame(0, 0, 0, 0, b"") +
      frame(1, 1, 5000, 0, b"a" * 4096) + frame(1, 1, 5000, 4096, b"b" * 904) + frame(3, 2, 4, 0, b"1234"))
write("tcp_frame", "recv_too_small", bytes([1]) + recvs((0, 4)) + frame(0, 0, 10, 0, b"0123456789"))


# ---- store_protocol: u8 config (bit 0: hello first; bit 1: the server has a token, which the hello carries;
# bit 2: the hello's token is wrong), then request frames (rendezvous/tcp_store_server.hpp, protocol version 2) ----
def sframe(payload):
    return struct.pack("<I", len(payload)) + payload


def s(v):
    v = v.encode()
    return struct.pack("<I", len(v)) + v


def keys(*ks):
    return struct.pack("<I", len(ks)) + b"".join(s(k) for k in ks)


SET, GET, WAIT, CHECK, ADD, CAS, REMOVE, NUM_KEYS, CANCEL = range(1, 10)
def hello_frame(version, token):
    return sframe(bytes([0]) + struct.pack("<II", 0x54534B53, version) + s(token))


hello = hello_frame(2, "")
write("store_protocol", "set_get_remove",
      bytes([1]) + sframe(bytes([SET]) + s("k") + s("v")) + sframe(bytes([GET]) + s("k")) +
      sframe(bytes([REMOVE]) + s("k")) + sframe(bytes([NUM_KEYS])))
write("store_protocol", "add_cas_check",
      bytes([1]) + sframe(bytes([ADD]) + s("n") + struct.pack("<q", 5)) + sframe(bytes([ADD]) + s("n") + struct.pack("<q", -2)) +
      sframe(bytes([CAS]) + s("c") + s("") + s("x")) + sframe(bytes([CAS]) + s("c") + s("x") + s("y")) +
      sframe(bytes([CHECK]) + keys("n", "c", "missing")))
write("store_protocol", "parked_wait_then_cancel",
      bytes([1]) + sframe(bytes([WAIT]) + keys("a", "b")) + sframe(bytes([CANCEL])) + sframe(bytes([SET]) + s("a") + s("1")))
write("store_protocol", "parked_get_released",
      bytes([1]) + sframe(bytes([GET]) + s("later")) + sframe(bytes([SET]) + s("later") + s("v")))
write("store_protocol", "explicit_hello_wrong_version", bytes([0]) + sframe(bytes([0]) + struct.pack("<II", 0x54534B53, 1)))
write("store_protocol", "explicit_hello_then_set", bytes([0]) + hello + sframe(bytes([SET]) + s("k") + s("v")))
write("store_protocol", "token_then_set", bytes([3]) + sframe(bytes([SET]) + s("k") + s("v")) + sframe(bytes([GET]) + s("k")))
write("store_protocol", "wrong_token_then_set", bytes([7]) + sframe(bytes([SET]) + s("k") + s("v")) + sframe(bytes([ADD]) + s("n") + struct.pack("<q", 1)))
write("store_protocol", "explicit_wrong_token", bytes([2]) + hello_frame(2, "fuzz-tokem") + sframe(bytes([SET]) + s("k") + s("v")))

# ---- ckpt_index: index JSON (ckpt/index.hpp; the documented example of docs/checkpoint-format.md) ----
write("ckpt_index", "documented_example", """{"format": "shardkit.ckpt", "version": 2, "step": 100, "world_size": 2, "metadata": {"run": "example"},
 "tensors": [
   {"name": "layer.w", "dtype": "F32", "global_shape": [2, 3]},
   {"name": "layer.b", "dtype": "F32", "global_shape": [3]},
   {"name": "rank/0/loader", "dtype": "U8", "global_shape": [3]},
   {"name": "rank/1/loader", "dtype": "U8", "global_shape": [3]}],
 "files": [
  {"key": "step-000000000100/rank-00000.safetensors", "size": 587,
   "pieces": [[0, 0, 3, 0, "9ee9050123e07b4e"], [1, 0, 3, 12, "6d50bdacee372b0e"], [2, 0, 3, 24, "5d3bedaf70c7c69e"]]},
  {"key": "step-000000000100/rank-00001.safetensors", "size": 415,
   "pieces": [[0, 3, 6, 0, "2ec5bd92b6b1d01e"], [3, 0, 3, 12, "699fb34a49760d71"]]}]}
""")
write("ckpt_index", "empty", '{"format": "shardkit.ckpt", "version": 2, "step": 0, "world_size": 1, "metadata": {}, "tensors": [], "files": []}')
write("ckpt_index", "bf16_scalar", json.dumps({"format": "shardkit.ckpt", "version": 2, "step": 7, "world_size": 1, "metadata": {},
      "tensors": [{"name": "s", "dtype": "BF16", "global_shape": []}, {"name": "i", "dtype": "I64", "global_shape": [4, 1]}],
      "files": [{"key": "f", "size": 200, "pieces": [[0, 0, 1, 0, "0000000000000001"], [1, 1, 3, 2, "ffffffffffffffff"]]}]}))
write("ckpt_index", "chunked_escaped", json.dumps({"files": [{"pieces": [[0, 0, 300000, 0, "00000000000000AA",
      "0123456789abcdef" "fedcba9876543210"]], "size": 1200000, "key": "a/b"}],
      "tensors": [{"global_shape": [300000], "dtype": "F32", "name": "caf\u00e9\n\ud83d\ude00"}],
      "metadata": {"k\"": "v\\"}, "world_size": 1, "step": 1, "version": 2, "format": "shardkit.ckpt"}, ensure_ascii=True, indent=1))

# ---- safetensors_header: u32 data size, then the header JSON (ckpt/format.hpp parse_header) ----
def st(data_size, header):
    return struct.pack("<I", data_size) + (header if isinstance(header, str) else json.dumps(header)).encode()


write("safetensors_header", "plain_two_tensors", st(20, {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                                                      "b": {"dtype": "I32", "shape": [1], "data_offsets": [16, 20]}}))
write("safetensors_header", "documented_rank1", st(15, """{"layer.w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
 "rank/1/loader": {"dtype": "U8", "shape": [3], "data_offsets": [12, 15]},
 "__metadata__": {"rank": "1", "step": "100", "world_size": "2",
                  "shardkit.layer.w": "{\\"begin\\":3,\\"end\\":6,\\"global_shape\\":[2,3],\\"xxh64\\":\\"2ec5bd92b6b1d01e\\"}",
                  "shardkit.rank/1/loader": "{\\"begin\\":0,\\"end\\":3,\\"global_shape\\":[3],\\"xxh64\\":\\"699fb34a49760d71\\"}"}}"""))
write("safetensors_header", "empty_tensor_and_metadata", st(0, {"e": {"dtype": "F16", "shape": [0, 4], "data_offsets": [0, 0]},
                                                                "__metadata__": {"format": "pt"}}))


# ---- loader_state: u8 (odd: repair size and checksum), then the blob (data/loader_state.hpp) ----
def text(t):
    return struct.pack("<I", len(t)) + t.encode()


def state(rank, world, logical, datasets, shards):
    fields = [("sequence_length", "65"), ("seed", str(rank)), ("files of dataset 'text'", "text.tokens (400 tokens, 3 documents)")]
    p = struct.pack("<IIIQ", rank, world, logical, 0x1234) + struct.pack("<I", len(fields))
    p += b"".join(text(n) + text(v) for n, v in fields) + struct.pack("<I", len(datasets))
    p += b"".join(struct.pack("<d", w) for w in datasets)
    p += struct.pack("<I", len(shards))
    for sid, open_ds in shards:
        p += struct.pack("<IQIQ", sid, 10, open_ds & 0xFFFFFFFF, 3 if open_ds >= 0 else 0)
        p += struct.pack("<I", len(datasets))
        for d in range(len(datasets)):
            p += struct.pack("<QQQQQQB", d, 99, 7, 1, 2, 1000, d % 2)
    head = b"SKDATAST" + struct.pack("<IIQ", 2, 0, len(p))
    return bytes([1]) + head + p + b"\0" * 8  # checksum repaired by the target


write("loader_state", "one_dataset_two_shards", state(0, 2, 4, [1.0], [(0, -1), (2, 0)]))
write("loader_state", "three_datasets_no_shards", state(1, 3, 2, [0.5, 0.25, 0.25], []))
write("loader_state", "mixed_open", state(3, 4, 16, [0.7, 0.3], [(3, 1), (7, -1), (15, 0)]))

# ---- token_sidecar: sidecar JSON (data/token_file.hpp) ----
write("token_sidecar", "u16_with_delimiter", '{"format":"shardkit.tokens","version":1,"dtype":"uint16","vocab":50257,"delimiter":50256,"offsets":false,"documents":3,"tokens":1000}')
write("token_sidecar", "u32_offsets", '{"format":"shardkit.tokens","version":1,"dtype":"uint32","offsets":true,"documents":12,"tokens":4096}')
write("token_sidecar", "minimal", '{"format":"shardkit.tokens","version":1,"dtype":"uint16","offsets":false,"documents":0,"tokens":0}')
