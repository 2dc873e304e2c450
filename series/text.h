#pragma once
// Hand-written readers of untrusted text, shared by the patch series files (patch_series.cpp, verdict.cpp).
// No std::regex here or anywhere else that reads file contents or user text: libstdc++'s executor recurses once per
// character a repetition consumes, so one line of tens of kB overflowed the stack (SIGSEGV in the launcher, and in
// any Python process whose first attention layer ran the check). These read a line in one pass, without recursion.
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace activekv::series {

/// ECMAScript's \s (and isspace(3) in the C locale) over bytes.
inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

inline std::string_view skip_spaces(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && is_space(s[i])) ++i;
  return s.substr(i);
}

/// Removes `prefix` from the front of `s` when `s` starts with it.
inline bool consume(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}

inline bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

/// The lines of a text as std::getline splits them (at '\n'; a last line without '\n' is a line, an empty text has
/// none), each without a final '\r' (CRLF files read as Python reads them). Views into the text, no copies.
class Lines {
 public:
  explicit Lines(std::string_view text) : rest_(text) {}
  bool next(std::string_view& line) {
    if (rest_.empty()) return false;
    const size_t end = rest_.find('\n');
    line = rest_.substr(0, end);
    rest_.remove_prefix(end == std::string_view::npos ? rest_.size() : end + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    return true;
  }

 private:
  std::string_view rest_;
};

/// `__version__ = 'X'` or `__version__ = version = 'X'` at the start of `line`: X. The reading of
/// tools/vllm_patch.py's _VERSION_RE, ^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]: whitespace around
/// each '=' optional, either quote (X ends at the first quote of either kind, and is not empty), anything after it.
inline std::optional<std::string_view> version_in_line(std::string_view line) {
  if (!consume(line, "__version__")) return std::nullopt;
  line = skip_spaces(line);
  if (!consume(line, "=")) return std::nullopt;
  line = skip_spaces(line);
  if (consume(line, "version")) {
    line = skip_spaces(line);
    if (!consume(line, "=")) return std::nullopt;
    line = skip_spaces(line);
  }
  if (line.empty() || (line[0] != '\'' && line[0] != '"')) return std::nullopt;
  line.remove_prefix(1);
  const size_t end = line.find_first_of("'\"");
  if (end == 0 || end == std::string_view::npos) return std::nullopt;
  return line.substr(0, end);
}

/// The two names of a whole line `diff --git a/OLD b/NEW` (tools/vllm_patch.py's _DIFF_RE,
/// ^diff --git a/(\S+) b/(\S+)$): OLD runs to the first whitespace, then exactly " b/", then NEW to the end; neither
/// empty nor holding whitespace. git quotes a name with whitespace ("a/x y"), which is no match, as in the twin.
inline std::optional<std::pair<std::string_view, std::string_view>> diff_git_names(std::string_view line) {
  if (!consume(line, "diff --git a/")) return std::nullopt;
  size_t end = 0;
  while (end < line.size() && !is_space(line[end])) ++end;
  const std::string_view old_name = line.substr(0, end);
  line.remove_prefix(end);
  if (old_name.empty() || !consume(line, " b/") || line.empty()) return std::nullopt;
  for (const char c : line) {
    if (is_space(c)) return std::nullopt;
  }
  return std::make_pair(old_name, line);
}

/// "fnv1a64:" and 16 lowercase hex digits: state_digest's form.
inline bool digest_form(std::string_view s) {
  if (!consume(s, "fnv1a64:") || s.size() != 16) return false;
  for (const char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

/// `s` for a message: each control character (NUL included) as \xNN, so an entry shows what it holds.
inline std::string shown(std::string_view s) {
  std::string out;
  for (const unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

}  // namespace activekv::series
