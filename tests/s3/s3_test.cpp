// The S3 sink: locations, addressing, credentials and encoding (no server needed), then against the test server
// (s3rver): multipart uploads byte-identical to a posix_sink copy, ranged and parallel reads, list pagination,
// batch delete, aborted uploads leaving nothing, virtual-hosted addressing. The errors of wrong credentials and a
// missing bucket: s3_errors_test.cpp.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "s3/s3_fixtures.hpp"
#include "shardkit/storage/open_sink.hpp"
#include "shardkit/storage/s3/detail/resolve.hpp"
#include "shardkit/storage/s3/detail/text.hpp"
#include "support/harness.hpp"
#include "support/scoped_env.hpp"

using namespace s3_test;
using shardkit::errc;
using shardkit::test::scoped_env;
namespace sd = shardkit::storage::detail::s3;

namespace {

std::vector<std::byte> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(chars.size());
  std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

}  // namespace

static_assert(st::sink<st::s3_sink>);

// ---------------------------------------------------------------------------------------------------------------
// No server needed

TEST_CASE("[s3] parse_s3_location: bucket and prefix, refusals name the location") {
  CHECK(st::parse_s3_location("s3://bucket") == st::s3_location{"bucket", ""});
  CHECK(st::parse_s3_location("s3://bucket/") == st::s3_location{"bucket", ""});
  CHECK(st::parse_s3_location("s3://my-bucket.eu/run-7") == st::s3_location{"my-bucket.eu", "run-7/"});
  CHECK(st::parse_s3_location("s3://b12/a/b/c//") == st::s3_location{"b12", "a/b/c/"});
  CHECK(st::to_string(st::parse_s3_location("s3://b12/a")) == "s3://b12/a/");
  for (const char* bad : {"s3://", "s3://ab", "gs://bucket/x", "/tmp/x", "s3://bucket/a//b", "s3://bucket/../x",
                          "s3://-bucket/x", "s3://bu cket", "s3://bucket/./x"}) {
    CAPTURE(bad);
    CHECK(contains(error_of([&] { st::parse_s3_location(bad); }, errc::invalid_argument), bad));
  }
  // S3's naming rules, each named.
  const std::pair<const char*, const char*> rules[] = {
      {"s3://my..bucket/p", "no two adjacent periods"}, {"s3://my.-bucket/p", "no period beside a hyphen"},
      {"s3://192.168.5.4/p", "not formatted as an IP address"}, {"s3://a/p", "3 to 63 characters"},
      {"s3://bucket-", "starts and ends with a letter or digit"}};
  for (const auto& [bad, rule] : rules) {
    CAPTURE(bad);
    CHECK(contains(error_of([&] { st::parse_s3_location(bad); }, errc::invalid_argument), rule));
  }
  CHECK(st::parse_s3_location("s3://123/p").bucket == "123");  // digits alone are a name, not an address
}

TEST_CASE("[s3] addressing: path style, virtual-hosted, and automatic by endpoint and bucket") {
  using st::s3_addressing;
  CHECK(sd::bucket_url("http://127.0.0.1:9000", "b-1", s3_addressing::automatic) == "http://127.0.0.1:9000/b-1");
  CHECK(sd::bucket_url("https://s3.eu-west-1.amazonaws.com", "b-1", s3_addressing::automatic) ==
        "https://b-1.s3.eu-west-1.amazonaws.com");
  // A dotted bucket over https would not match the wildcard certificate: path style.
  CHECK(sd::bucket_url("https://s3.eu-west-1.amazonaws.com", "a.b", s3_addressing::automatic) ==
        "https://s3.eu-west-1.amazonaws.com/a.b");
  CHECK(sd::bucket_url("https://s3.amazonaws.com", "Old_Bucket", s3_addressing::automatic) ==
        "https://s3.amazonaws.com/Old_Bucket");
  CHECK(sd::bucket_url("http://minio:9000", "b-1", s3_addressing::virtual_hosted) == "http://b-1.minio:9000");
  CHECK(sd::bucket_url("https://s3.amazonaws.com", "b-1", s3_addressing::path) == "https://s3.amazonaws.com/b-1");
}

TEST_CASE("[s3] encoding: SigV4 URI encoding, XML, Content-MD5") {
  CHECK(sd::uri_encode("a b/c~d_e.f-g+h=é", true) == "a%20b/c~d_e.f-g%2Bh%3D%C3%A9");
  CHECK(sd::uri_encode("a/b", false) == "a%2Fb");
  CHECK(sd::xml_values("<R><Key>a&amp;b</Key><Key>&lt;c&gt;&#233;</Key></R>", "Key") ==
        std::vector<std::string>{"a&b", "<c>\xC3\xA9"});
  CHECK(sd::xml_escape("a<&>'\"") == "a&lt;&amp;&gt;&apos;&quot;");
  const auto md5_of = [](std::string_view s) {
    const auto d = sd::md5(st::as_bytes(s));
    return sd::base64(d);
  };
  CHECK(md5_of("") == "1B2M2Y8AsgTpgAmY7PhCfg==");                                     // d41d8cd9...
  CHECK(md5_of("abc") == "kAFQmDzST7DWlj99KOF/cg==");                                  // 90015098...
  CHECK(md5_of("The quick brown fox jumps over the lazy dog") == "nhB9nTcrtoJr2B01QqQZ1g==");  // 9e107d9d...
  std::string long_text(1000, 'x');
  CHECK(md5_of(long_text).size() == 24);
}

TEST_CASE("[s3] credentials: environment first, then the shared credentials file's profile") {
  temp_dir dir;
  const auto file = (dir.path / "credentials").string();
  std::ofstream(file) << "# comment\n[other]\naws_access_key_id = OTHERID\naws_secret_access_key = othersecret\n\n"
                         "[default]\naws_access_key_id=DEFAULTID\n aws_secret_access_key = defaultsecret \n"
                         "aws_session_token = tok\n";
  scoped_env id("AWS_ACCESS_KEY_ID", nullptr), secret("AWS_SECRET_ACCESS_KEY", nullptr),
      token("AWS_SESSION_TOKEN", nullptr), profile("AWS_PROFILE", nullptr), path("AWS_SHARED_CREDENTIALS_FILE", file.c_str());
  auto c = sd::resolve_credentials();
  CHECK(c.access_key_id == "DEFAULTID");
  CHECK(c.secret_access_key == "defaultsecret");
  CHECK(c.session_token == "tok");
  {
    scoped_env p("AWS_PROFILE", "other");
    CHECK(sd::resolve_credentials().access_key_id == "OTHERID");
  }
  {
    scoped_env i("AWS_ACCESS_KEY_ID", "ENVID"), s("AWS_SECRET_ACCESS_KEY", "envsecret");
    CHECK(sd::resolve_credentials().access_key_id == "ENVID");
  }
  scoped_env none("AWS_SHARED_CREDENTIALS_FILE", (dir.path / "missing").string().c_str());
  const auto what = error_of([] { sd::resolve_credentials(); }, errc::config);
  CHECK(contains(what, "AWS_ACCESS_KEY_ID"));
  CHECK_FALSE(contains(what, "defaultsecret"));
  CHECK_FALSE(contains(what, "othersecret"));
}

TEST_CASE("[s3] open_sink: directories, file://, memory:, s3:// and unknown schemes") {
  temp_dir dir;
  auto a = st::open_sink((dir.path / "plain").string());
  put_string(a, "k", "v");
  CHECK(fs::exists(dir.path / "plain" / "k"));
  auto b = st::open_sink("file://" + (dir.path / "url").string());
  put_string(b, "k", "v");
  CHECK(fs::exists(dir.path / "url" / "k"));
  auto m = st::open_sink("memory:");
  put_string(m, "k", "v");
  CHECK(read_string(m, "k") == "v");
  CHECK(contains(error_of([] { st::open_sink("gs://bucket/x"); }, errc::invalid_argument), "gs"));
  error_of([] { st::open_sink("file://relative"); }, errc::invalid_argument);
  error_of([] { st::open_sink(""); }, errc::invalid_argument);
  st::open_sink_options o;
  o.s3 = st::s3_options{};
  o.s3->endpoint = "http://127.0.0.1:1";
  o.s3->credentials = st::s3_credentials{"ID", "SECRET", ""};
  auto s = st::open_sink("s3://some-bucket/run-1", o);  // sends nothing until used
  CHECK(static_cast<bool>(s));
}

TEST_CASE("[s3] keys: past S3's 1,024 bytes (the prefix included) refused before anything is sent") {
  st::s3_options o;
  o.endpoint = "http://127.0.0.1:1";  // nothing listens: a request would fail with a connection error instead
  o.credentials = st::s3_credentials{"ID", "SECRET", ""};
  o.max_attempts = 1;
  st::s3_sink s(st::s3_location{"bucket", "run-7/"}, o);  // 6 bytes of prefix
  const std::string fits(1024 - 6, 'k'), over(1024 - 5, 'k');
  error_of([&] { put_string(s, fits, "x"); }, errc::io);  // sent (and refused by nobody listening)
  const auto what = error_of([&] { s.put(over); }, errc::invalid_argument);
  CHECK(contains(what, "1024 bytes"));
  CHECK(contains(what, "1025"));
  error_of([&] { s.put(over, 10); }, errc::invalid_argument);
  // The sink says its limit (sink_limits_keys), the prefix taken off, and any_sink forwards it: a checkpointer
  // refuses a prefix whose keys would not fit when it is made (ckpt key_limits_test, s3_ckpt_test).
  const auto limits = st::any_sink(std::make_shared<st::s3_sink>(st::s3_location{"bucket", "run-7/"}, o)).key_limits();
  CHECK(limits.key_bytes == 1024 - 6);
  CHECK(limits.component_bytes == 0);
  CHECK(limits.source == "S3 keys are at most 1024 bytes, and this sink's prefix 'run-7/' takes 6 of them");
  CHECK(st::key_limit_problem(limits, fits).empty());
  CHECK(st::key_limit_problem(limits, over) == "'" + over + "' is 1019 bytes, over the 1018 this sink allows (" + limits.source + ")");
}

// ---------------------------------------------------------------------------------------------------------------
// Against the server

TEST_CASE("[s3] multipart upload: byte-identical to the posix_sink copy, parts in parallel") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.part_size = 256 << 10;
  o.parallel = 4;
  const auto loc = location("multipart");
  st::s3_sink s3(loc, o);
  temp_dir dir;
  st::posix_sink posix(dir.path, {.fsync = false});
  const auto data = pattern((3 << 20) + 12345, 7);  // 12 full parts and a short one
  auto ws = s3.put("ckpt/rank-0.safetensors");
  auto wp = posix.put("ckpt/rank-0.safetensors");
  std::size_t at = 0, step = 1;
  while (at < data.size()) {  // chunks of growing, odd sizes that straddle part boundaries
    const std::size_t n = std::min(step, data.size() - at);
    ws.write(std::span(data).subspan(at, n));
    wp.write(std::span(data).subspan(at, n));
    at += n;
    step = step * 3 + 1;
  }
  CHECK(s3.pending_uploads("ckpt/").size() == 1);  // started, not visible
  CHECK_FALSE(s3.exists("ckpt/rank-0.safetensors"));
  ws.commit();
  wp.commit();
  CHECK(s3.pending_uploads().empty());
  CHECK(s3.size("ckpt/rank-0.safetensors") == data.size());
  const auto from_s3 = st::get_object(s3, "ckpt/rank-0.safetensors");
  CHECK(from_s3 == read_file(posix.path_of("ckpt/rank-0.safetensors")));
  CHECK(from_s3 == data);
  // The server's stored file itself (s3rver keeps each object as <data>/<bucket>/<key>._S3rver_object).
  if (!server()->data_dir.empty()) {
    const fs::path stored =
        fs::path(server()->data_dir) / loc.bucket / (loc.prefix + "ckpt/rank-0.safetensors._S3rver_object");
    CHECK(read_file(stored) == read_file(posix.path_of("ckpt/rank-0.safetensors")));
  }
  // An object of exactly N parts (no short last part) and one of exactly one part.
  for (std::size_t n : {std::size_t(2) * o.part_size, o.part_size}) {
    const auto d = pattern(n, 3);
    st::put_object(s3, "exact-" + std::to_string(n), d);
    CHECK(st::get_object(s3, "exact-" + std::to_string(n)) == d);
  }
}

TEST_CASE("[s3] ranged reads: small ranges, parallel large ranges, past the end") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.part_size = 64 << 10;  // reads above 64 KiB are parallel ranged GETs
  o.parallel = 4;
  st::s3_sink s(location("ranges"), o);
  const auto data = pattern((1 << 20) + 777, 11);
  st::put_object(s, "obj", data);
  for (auto [offset, n] : {std::pair<std::uint64_t, std::size_t>{0, 1}, {12345, 100}, {65535, 2}, {0, 64 << 10},
                           {1, (64 << 10) + 1}, {12345, 700000}, {0, data.size()}, {100, data.size()}}) {
    CAPTURE(offset);
    CAPTURE(n);
    std::vector<std::byte> buf(n);
    const std::size_t expect = std::min<std::uint64_t>(n, data.size() - offset);
    REQUIRE(s.get("obj", offset, buf) == expect);
    CHECK(std::equal(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(expect), data.begin() + static_cast<std::ptrdiff_t>(offset)));
  }
  std::vector<std::byte> buf(300000);
  CHECK(s.get("obj", data.size(), buf) == 0);
  CHECK(s.get("obj", data.size() - 10, buf) == 10);
  CHECK(s.get("obj", data.size() + 5, buf) == 0);
  CHECK(contains(error_of([&] { s.get("missing", 0, buf); }, errc::not_found), "'missing'"));
}

TEST_CASE("[s3] list: pagination with continuation tokens, prefixes, keys outside the sink's prefix") {
  if (!server_or_skip()) return;
  const auto loc = location("list");
  st::s3_sink s(loc, options_for(*server()));
  s.set_list_page_size(3);
  std::vector<std::string> keys;
  for (int i = 0; i < 14; ++i) keys.push_back("step-" + std::to_string(i % 3) + "/rank-" + std::to_string(i));
  shardkit::test::run_threads(7, [&](int t) {
    for (int i = t; i < 14; i += 7) put_string(s, keys[static_cast<std::size_t>(i)], keys[static_cast<std::size_t>(i)]);
  });
  std::sort(keys.begin(), keys.end());
  CHECK(s.list("") == keys);
  std::vector<std::string> step1;
  for (const auto& k : keys)
    if (k.starts_with("step-1/")) step1.push_back(k);
  CHECK(s.list("step-1/") == step1);
  CHECK(s.list("step-9").empty());
  // A sibling prefix's objects are not this sink's.
  st::s3_sink sibling(st::s3_location{loc.bucket, loc.prefix.substr(0, loc.prefix.size() - 1) + "x/"}, options_for(*server()));
  put_string(sibling, "other", "x");
  CHECK(s.list("").size() == keys.size());
}

TEST_CASE("[s3] remove_objects: DeleteObjects in batches of 1000, missing keys are fine") {
  if (!server_or_skip()) return;
  st::s3_sink s(location("batch-delete"), options_for(*server()));
  std::vector<std::string> keys;
  for (int i = 0; i < 1003; ++i) keys.push_back("old/" + std::to_string(i));
  shardkit::test::run_threads(8, [&](int t) {
    for (std::size_t i = static_cast<std::size_t>(t); i < keys.size(); i += 8) put_string(s, keys[i], "x");
  });
  put_string(s, "keep/index.json", "{}");
  REQUIRE(s.list("old/").size() == keys.size());
  keys.push_back("old/never-written");
  s.remove_objects(keys);
  CHECK(s.list("old/").empty());
  CHECK(s.list("") == std::vector<std::string>{"keep/index.json"});
  s.remove_objects(std::vector<std::string>{});  // nothing to do
  CHECK(s.remove("keep/index.json"));
  CHECK_FALSE(s.remove("keep/index.json"));
}

TEST_CASE("[s3] aborted and failed uploads leave no object and no pending upload") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.part_size = 16 << 10;
  o.parallel = 2;
  st::s3_sink s(location("abort"), o);
  const auto data = pattern(200000, 5);
  {
    auto w = s.put("a/aborted");
    w.write(data);
    CHECK(s.pending_uploads().size() == 1);
    w.abort();
  }
  {
    auto w = s.put("a/abandoned");  // destroyed unfinished
    w.write(data);
  }
  {
    auto w = s.put("a/moved");
    auto other = std::move(w);
    other.write(data);
    w = s.put("a/replaced");  // assigning over a writer aborts what it held
    w.write(data);
  }
  CHECK(s.pending_uploads().empty());
  CHECK(s.list("").empty());
  CHECK_FALSE(s.exists("a/aborted"));

  // A writer that never finishes (a killed process): its upload stays pending until abort_pending_uploads().
  auto* leaked = new st::s3_sink::writer(s.put("a/killed"));
  leaked->write(data);
  REQUIRE(s.pending_uploads().size() == 1);
  CHECK(s.pending_uploads().front().key == "a/killed");
  CHECK(s.abort_pending_uploads() == 1);
  CHECK(s.pending_uploads().empty());
  error_of([&] { leaked->commit(); }, errc::io);  // its upload is gone: the commit fails, nothing is visible
  delete leaked;
  CHECK_FALSE(s.exists("a/killed"));
  CHECK(s.pending_uploads().empty());
}

TEST_CASE("[s3] virtual-hosted addressing and session tokens") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  // s3rver maps <bucket>.s3.localhost onto the bucket; libcurl resolves *.localhost to loopback itself.
  const auto port = server()->endpoint.substr(server()->endpoint.rfind(':') + 1);
  o.endpoint = "http://s3.localhost:" + port;
  o.addressing = st::s3_addressing::virtual_hosted;
  o.credentials->session_token = "FwoGZXIvYXdzEXAMPLETOKEN";  // signed as x-amz-security-token
  st::s3_sink s(location("vhost"), o);
  put_string(s, "a/b c+d", "virtual");
  CHECK(read_string(s, "a/b c+d") == "virtual");
  CHECK(s.list("") == std::vector<std::string>{"a/b c+d"});
}

TEST_CASE("[s3] every kind of request is signed as S3 verifies it; a wrong secret and a revoked key fail at once") {
  if (!server_or_skip()) return;
  if (!front::present()) {
    MESSAGE("[s3] no signature-verifying front before the server (scripts/lib/s3rver.sh starts one): case skipped");
    return;
  }
  // A key of this test's own, so that its counts and its revocation touch no other suite.
  const std::string id = "SKSIGN" + unique_prefix("k").substr(2, 16), secret = "sign-test-secret/+=" + id;
  front::add_key(id, secret);
  auto o = options_for(*server());
  o.credentials = st::s3_credentials{id, secret, "FwoGZXIvYXdzEXAMPLETOKEN"};  // x-amz-security-token signed too
  o.part_size = 4096;
  o.parallel = 2;
  st::s3_sink s(location("signed"), o);
  const auto big = pattern(3 * 4096 + 5, 3);
  const std::string odd = "a b+c=d/é~x&y%z";  // every character SigV4 encodes, in the path and in list's prefix
  st::put_object(s, odd, big);                 // multipart: Create, UploadPart, Complete
  put_string(s, "small/one", "x");             // PutObject
  CHECK(st::get_object(s, odd) == big);        // parallel ranged GETs
  CHECK(s.size(odd) == big.size());            // HEAD
  CHECK_FALSE(s.exists("small/none"));         // HEAD 404, then the bucket check (ListObjectsV2)
  s.set_list_page_size(1);
  CHECK(s.list("") == std::vector<std::string>{odd, "small/one"});  // continuation tokens
  CHECK(s.list("a b+c") == std::vector<std::string>{odd});
  {
    auto w = s.put("aborted");
    w.write(big);
    CHECK(s.pending_uploads().size() == 1);  // ListMultipartUploads
  }                                          // AbortMultipartUpload
  auto leaked = std::make_unique<st::s3_sink::writer>(s.put("leaked"));
  leaked->write(big);
  CHECK(s.abort_pending_uploads() == 1);
  leaked.reset();
  CHECK(s.remove("small/one"));                // HEAD + DeleteObject
  s.remove_objects(std::vector<std::string>{odd, "never"});  // DeleteObjects with Content-MD5
  CHECK(s.list("").empty());
  auto counts = front::counts_of(id);
  CHECK(counts.refused == 0);
  CHECK(counts.verified >= 20);

  auto wrong = o;
  wrong.credentials->secret_access_key = "not-the-secret";
  wrong.max_attempts = 8;
  wrong.base_backoff = std::chrono::milliseconds(200);
  st::s3_sink bad(location("signed"), wrong);
  const auto t0 = std::chrono::steady_clock::now();
  const auto mismatch = error_of([&] { put_string(bad, "k", "x"); }, errc::io);
  CHECK(contains(mismatch, "403 SignatureDoesNotMatch"));
  CHECK(contains(mismatch, "not retried"));
  CHECK_FALSE(contains(mismatch, "not-the-secret"));
  CHECK(front::counts_of(id).refused == 1);

  front::revoke_key(id);  // credentials withdrawn mid-run: the same sink's next request is refused, at once
  const auto revoked = error_of([&] { put_string(s, "after", "x"); }, errc::io);
  CHECK(contains(revoked, "403 InvalidAccessKeyId"));
  CHECK(contains(revoked, "not retried"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
  CHECK(front::counts_of(id).refused == 2);
}

TEST_CASE("[s3] part count: a sized put grows its parts to fit max_parts; an unsized one fails before one more") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.part_size = 4096;
  o.parallel = 2;
  o.max_parts = 4;  // S3's 10,000, made small: 4 parts of 4 KiB hold 16 KiB
  const auto loc = location("parts");
  st::s3_sink s(loc, o);
  const auto data = pattern(5 * 4096 + 1, 9);  // needs 6 parts of 4 KiB: 4 of 5121 bytes when the size is known
  {
    auto w = s.put("sized", data.size());
    for (std::size_t at = 0; at < data.size(); at += 1000) w.write(std::span(data).subspan(at, std::min<std::size_t>(1000, data.size() - at)));
    w.commit();
  }
  CHECK(st::get_object(s, "sized") == data);
  st::any_sink any = st::make_sink<st::s3_sink>(loc, o);  // any_sink forwards the size
  static_assert(st::sink_puts_sized<st::any_sink>);
  {
    auto w = st::put_sized(any, "sized-any", data.size());
    w.write(data);
    w.commit();
  }
  CHECK(st::get_object(any, "sized-any") == data);

  // Unknown size: the writer stops at the 4th full part, before sending a 5th, and leaves nothing behind.
  auto w = s.put("unsized");
  const auto what = error_of([&] { w.write(data); }, errc::invalid_argument);
  CHECK(contains(what, "outgrew the 4 parts"));
  CHECK(contains(what, "s3://" + loc.bucket + "/" + loc.prefix + "unsized"));
  CHECK(contains(what, "SHARDKIT_S3_PART_SIZE"));
  error_of([&] { w.commit(); }, errc::aborted);
  CHECK_FALSE(s.exists("unsized"));
  CHECK(s.pending_uploads().empty());
  // Exactly max_parts full parts is fine.
  st::put_object(s, "four", pattern(4 * 4096, 2));
  CHECK(s.size("four") == 4 * 4096);

  CHECK(contains(error_of([&] { s.put("huge", (std::uint64_t(5) << 40) + 1); }, errc::invalid_argument), "5 TiB"));
}

TEST_CASE("[s3] SHARDKIT_S3_PART_SIZE: S3's limits, 5 MiB to 5 GiB; smaller in-code parts stay allowed for test servers") {
  {
    scoped_env e("SHARDKIT_S3_PART_SIZE", "6G");
    error_of([] { st::s3_options::from_env(); }, errc::config);
  }
  {
    scoped_env e("SHARDKIT_S3_PART_SIZE", "5G");
    CHECK(st::s3_options::from_env().part_size == std::size_t(5) << 30);
  }
  for (const char* small : {"1", "1M", "5242879"}) {  // 1 byte: ~10,000 parts per file, a tiny run took minutes
    scoped_env e("SHARDKIT_S3_PART_SIZE", small);
    const auto what = error_of([] { st::s3_options::from_env(); }, errc::config);
    CHECK(contains(what, std::string("SHARDKIT_S3_PART_SIZE='") + small + "'"));
    CHECK(contains(what, "S3 takes parts of 5 MiB (every part but an object's last) to 5 GiB"));
  }
  {
    scoped_env e("SHARDKIT_S3_PART_SIZE", "5M");
    CHECK(st::s3_options::from_env().part_size == std::size_t(5) << 20);
  }
  st::s3_options o;
  o.endpoint = "http://127.0.0.1:1";
  o.credentials = st::s3_credentials{"ID", "SECRET", ""};
  o.part_size = (std::size_t(5) << 30) + 1;
  error_of([&] { st::s3_sink s(st::s3_location{"bucket", ""}, o); }, errc::config);
  o.part_size = 4096;  // small in-code parts (the tests', for servers that take them) stay allowed
  st::s3_sink small(st::s3_location{"bucket", ""}, o);
}

TEST_CASE("[s3] an endpoint whose path names the bucket is refused when the sink is made, saying where the bucket goes") {
  st::s3_options o;
  o.credentials = st::s3_credentials{"ID", "SECRET", ""};
  for (const char* endpoint : {"http://127.0.0.1:1/bucket", "http://127.0.0.1:1/bucket/", "https://gw.example/s3/bucket"}) {
    CAPTURE(endpoint);
    o.endpoint = endpoint;
    const auto what = error_of([&] { st::s3_sink s(st::s3_location{"bucket", "p/"}, o); }, errc::config);
    CHECK(contains(what, "ends with the bucket's name 'bucket'"));
    CHECK(contains(what, "the bucket goes in the location s3://bucket/prefix"));
  }
  o.endpoint = "https://gw.example/s3";  // a gateway served under a path stays allowed
  st::s3_sink gateway(st::s3_location{"bucket", ""}, o);
  CHECK(gateway.options().endpoint == "https://gw.example/s3");
}

TEST_CASE("[s3] a governed sink paces uploads (checkpoint class, tx) and reads (data class, rx); without one, "
          "untouched") {
  using namespace std::chrono_literals;
  namespace sk = shardkit;
  const auto tx = sk::link_direction::tx, rx = sk::link_direction::rx;
  // 8 MiB/s each way, 50 ms window (a burst of 400 KiB), the whole link for S3 (no floor: what collectives leave).
  constexpr std::uint64_t rate = 8u << 20;
  sk::link_governor link("s3", {.bytes_per_second = rate, .unreported_share_percent = 100, .floor_percent = 0,
                                .window = 50ms});
  {  // from the environment: on when the capacity is set, on the link SHARDKIT_S3_LINK names
    scoped_env off("SHARDKIT_LINK_BYTES_PER_SECOND", "0");
    CHECK(st::s3_options::from_env().governor == nullptr);
    scoped_env on("SHARDKIT_LINK_BYTES_PER_SECOND", "64M"), named("SHARDKIT_S3_LINK", "s3-test-eth9");
    const auto* g = st::s3_options::from_env().governor;
    REQUIRE(g != nullptr);
    CHECK(g->name() == "s3-test-eth9");
    CHECK(g->options().bytes_per_second == 64u << 20);
  }
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.part_size = 512 << 10;  // 4 parts, all in flight at once: the governor is shared by their connections
  o.parallel = 4;
  o.governor = &link;
  st::s3_sink paced(location("paced"), o);
  const auto data = pattern(2u << 20, 5);
  const double floor = double(data.size() - link.budget()) / double(rate);  // seconds, after the first burst
  // Collectives report, and keep one direction full (twice its capacity, reported as it goes) while a transfer
  // runs the other way: it does not see them and goes at the link's rate. Were it paced against them, it would
  // move only 16 KiB steps, one per a quarter of the stall timeout.
  auto collectives = link.attach_reporter();
  const auto while_full = [&](sk::link_direction busy, const auto& transfer) {
    std::atomic<bool> running{true};
    std::thread sender([&] {
      for (auto last = sk::link_governor::clock::now(); running;) {
        std::this_thread::sleep_for(1ms);
        const auto now = sk::link_governor::clock::now();
        link.report(busy, sk::traffic_class::collectives,
                    std::uint64_t(2 * double(rate) * std::chrono::duration<double>(now - last).count()));
        last = now;
      }
    });
    const double took = seconds_of(transfer);
    running = false;
    sender.join();
    return took;
  };
  const double up = while_full(rx, [&] { st::put_object(paced, "obj", data); });
  CHECK(up >= floor);
  CHECK(up < 20);
  CHECK(link.sent(tx, sk::traffic_class::checkpoint) >= data.size());
  CHECK(link.sent(rx, sk::traffic_class::checkpoint) == 0);
  std::vector<std::byte> back(data.size());
  const double down = while_full(tx, [&] { CHECK(paced.get("obj", 0, back) == data.size()); });
  CHECK(down >= floor);
  CHECK(down < 20);
  CHECK(back == data);
  CHECK(link.sent(rx, sk::traffic_class::data) >= data.size());
  CHECK(link.sent(tx, sk::traffic_class::data) == 0);
  MESSAGE("paced at 8 MiB/s: upload ", up, " s, download ", down, " s (floor ", floor, " s)");
  collectives.reset();

  auto plain_options = options_for(*server());
  plain_options.part_size = o.part_size;
  plain_options.parallel = o.parallel;
  st::s3_sink plain(location("paced"), plain_options);
  const auto counted = [&] {
    std::uint64_t n = 0;
    for (auto d : {tx, rx}) n += link.sent(d, sk::traffic_class::checkpoint) + link.sent(d, sk::traffic_class::data);
    return n;
  };
  const auto before = counted();
  const double plain_up = seconds_of([&] { st::put_object(plain, "obj2", data); });
  CHECK(st::get_object(plain, "obj2") == data);
  MESSAGE("unpaced upload ", plain_up, " s");
  CHECK(counted() == before);
}

TEST_CASE("[s3] a governed upload waits while a collectives' write is in progress, resumes once it ends, and is "
          "granted at most 128 KiB at a time") {
  using namespace std::chrono_literals;
  namespace sk = shardkit;
  const auto tx = sk::link_direction::tx;
  const auto checkpoint = sk::traffic_class::checkpoint;
  // 64 MiB/s, a 50 ms window (3.3 MiB: by use alone a whole part at once), no floor: while collectives write, the
  // upload gets nothing.
  sk::link_governor link("s3", {.bytes_per_second = 64u << 20, .floor_percent = 0, .window = 50ms});
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.part_size = 512 << 10;
  o.parallel = 4;
  o.governor = &link;
  st::s3_sink paced(location("held"), o);
  const auto data = pattern(2u << 20, 9);
  auto collectives = link.attach_reporter();
  link.demand_begin(tx, 1u << 20);
  std::atomic<bool> done{false};
  std::thread upload([&] {
    st::put_object(paced, "obj", data);
    done = true;
  });
  std::this_thread::sleep_for(500ms);  // far below the stall timeout's quarter (7.5 s), where a step would move
  const bool done_while_held = done.load();
  const auto sent_while_held = link.sent(tx, checkpoint);
  const auto ended = sk::link_governor::clock::now();
  link.demand_end(tx);
  upload.join();
  const double took = std::chrono::duration<double>(sk::link_governor::clock::now() - ended).count();
  CHECK_FALSE(done_while_held);
  CHECK(sent_while_held == 0);
  CHECK(took < 10);
  CHECK(link.sent(tx, checkpoint) >= data.size());
  CHECK(link.largest_grant(tx, checkpoint) <= 128u << 10);
  CHECK(link.largest_grant(tx, checkpoint) > 0);
  CHECK(st::get_object(paced, "obj") == data);
  MESSAGE("held 0.5 s, then uploaded 2 MiB in ", took, " s; largest grant ", link.largest_grant(tx, checkpoint));
}
