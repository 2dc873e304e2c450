// float_repr (telemetry.h): a double as Python's repr(float) writes it, for the Prometheus `le` labels and the HTTP
// routes' JSON numbers.
//
// The shortest digits come from {fmt} (its Dragonbox: the shortest string that reads back exactly, and of those the
// nearest), header-only from the copy torch ships in its include folder. Not std::to_chars(double): GCC 10's
// libstdc++, the manylinux_2_31 build's (docs/release.md), has none, and GCC 11's needs GLIBCXX_3.4.29. Not a loop
// over snprintf("%.*e") precisions with a strtod round trip either: at a power of two the correctly rounded digits
// of a length can miss while other digits of that length read back, and that loop then gives one digit more than
// repr (46 of 134790 values compared with repr: random bit patterns, integers, powers of two and ten; e.g.
// 7.1202363472230444e-307 for repr's 7.120236347223045e-307).
#include <activekv/telemetry.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>

// Header-only, with hidden symbols: the engine library exports its own API (default visibility), not a copy of {fmt}
// a process could bind instead of torch's or another library's.
#define FMT_HEADER_ONLY
#pragma GCC visibility push(hidden)
#include <fmt/format.h>
#pragma GCC visibility pop

namespace activekv {

std::string float_repr(double v) {
  if (std::isnan(v)) return "nan";  // repr drops a NaN's sign; {fmt} writes "-nan"
  // "{}": the shortest round-trip digits, fixed notation for decimal exponents -4..15 and "1e+16"/"1e-05" beyond,
  // "inf"/"-inf", as repr; only its integral fixed forms lack repr's ".0" ("1", "-0", "1000000000000000").
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".ei") == std::string::npos) s += ".0";
  return s;
}

}  // namespace activekv
