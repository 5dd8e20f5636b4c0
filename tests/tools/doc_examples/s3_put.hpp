// docs/s3.md: the bytes to store.
#include <cstddef>
#include <vector>

extern std::vector<std::byte> bytes;
