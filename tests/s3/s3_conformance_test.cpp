// The storage conformance suite (tests/storage/storage_test.cpp, every case) over the S3 sink against the test
// server: once with single PutObjects, once with tiny parts so that every object is a parallel multipart upload.
#define SINK_FIXTURES s3_fixture, s3_multipart_fixture
#include "s3/s3_fixtures.hpp"

using namespace s3_test;
#include "storage/storage_test.cpp"
