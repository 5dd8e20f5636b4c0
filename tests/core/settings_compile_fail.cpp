// Compiled by tests/core/CMakeLists.txt with -fsyntax-only, once per case: each must fail to compile, naming
// the check (settings::declared's consteval constructor). Without a case it compiles: the control.
#include "shardkit/core/settings.hpp"

namespace settings = shardkit::settings;

int main() {
  (void)settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTES");
#if defined(SHARDKIT_CASE_UNDECLARED)
  (void)settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTE");  // a typo: not in settings_table.hpp
#elif defined(SHARDKIT_CASE_WRONG_TYPE)
  (void)settings::get<settings::integer>("SHARDKIT_SEGMENT_BYTES");  // declared as bytes
#endif
}
