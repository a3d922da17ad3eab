#include "core/scenario_units.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string_view>

namespace dssim {

const char* to_string(Dimension d) {
  switch (d) {
    case Dimension::None: return "number";
    case Dimension::Bytes: return "size";
    case Dimension::Bandwidth: return "bandwidth";
    case Dimension::Time: return "time";
    case Dimension::FlopRate: return "FLOP rate";
    case Dimension::Flops: return "FLOP count";
    case Dimension::Power: return "power";
  }
  return "?";
}

std::string example_of(Dimension d) {
  switch (d) {
    case Dimension::None: return "a number";
    case Dimension::Bytes: return "a size such as '80 GiB' or 85899345920 (bytes)";
    case Dimension::Bandwidth: return "a bandwidth such as '200 Gb/s', '300 GB/s' or 25e9 (bytes/s)";
    case Dimension::Time: return "a time such as '2 us', '0.5 ms' or 2e-6 (seconds)";
    case Dimension::FlopRate: return "a FLOP rate such as '312 TFLOP/s' or 312e12 (FLOP/s)";
    case Dimension::Flops: return "a FLOP count such as '5 GFLOP' or 5e9";
    case Dimension::Power: return "a power such as '500 W', '0.7 kW' or 500 (watts)";
  }
  return "a number";
}

namespace {

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// Decimal (k, M, G, ...) or binary (Ki, Mi, Gi, ...) prefix at the start of `u`; advances `u`.
double take_prefix(std::string_view& u, bool allow_binary, bool allow_small) {
  if (u.empty()) return 1;
  if (allow_binary && u.size() >= 2 && u[1] == 'i') {
    double f = 0;
    switch (u[0]) {
      case 'K': case 'k': f = 0x1p10; break;
      case 'M': f = 0x1p20; break;
      case 'G': f = 0x1p30; break;
      case 'T': f = 0x1p40; break;
      case 'P': f = 0x1p50; break;
      default: break;
    }
    if (f != 0) { u.remove_prefix(2); return f; }
  }
  double f = 0;
  switch (u[0]) {
    case 'k': case 'K': f = 1e3; break;
    case 'M': f = 1e6; break;
    case 'G': f = 1e9; break;
    case 'T': f = 1e12; break;
    case 'P': f = 1e15; break;
    case 'E': f = 1e18; break;
    default: break;
  }
  if (allow_small) {
    if (starts_with(u, "µ") || starts_with(u, "μ")) { u.remove_prefix(starts_with(u, "µ") ? std::string_view("µ").size() : std::string_view("μ").size()); return 1e-6; }
    switch (u[0]) {
      case 'm': f = 1e-3; break;
      case 'u': f = 1e-6; break;
      case 'n': f = 1e-9; break;
      case 'p': f = 1e-12; break;
      default: break;
    }
  }
  if (f != 0 && u.size() > 1) { u.remove_prefix(1); return f; }
  return 1;
}

// Bytes or bits with prefix; returns factor to bytes, or 0.
double data_unit(std::string_view u) {
  std::string_view v = u;
  double p = take_prefix(v, true, false);
  if (v == "B" || v == "byte" || v == "bytes") return p;
  if (v == "b" || v == "bit" || v == "bits") return p / 8;
  // a lone prefix-less "B" is covered above; also accept "GB" where take_prefix consumed nothing
  return 0;
}

std::optional<double> unit_factor(std::string u, Dimension d) {
  if (u.empty()) return 1;  // a plain number is already in SI
  switch (d) {
    case Dimension::None:
      return u.empty() ? std::optional<double>(1) : std::nullopt;
    case Dimension::Bytes: {
      double f = data_unit(u);
      return f > 0 ? std::optional<double>(f) : std::nullopt;
    }
    case Dimension::Bandwidth: {
      std::string_view v = u;
      std::string base;
      if (v.size() > 2 && v.substr(v.size() - 2) == "/s") base = std::string(v.substr(0, v.size() - 2));
      else if (v.size() > 2 && v.substr(v.size() - 2) == "ps") base = std::string(v.substr(0, v.size() - 2));
      else return std::nullopt;
      base = trim(base);
      double f = data_unit(base);
      return f > 0 ? std::optional<double>(f) : std::nullopt;
    }
    case Dimension::Time: {
      std::string_view v = u;
      if (v == "s" || v == "sec" || v == "second" || v == "seconds") return 1;
      double p = take_prefix(v, false, true);
      if (p < 1 && v == "s") return p;
      return std::nullopt;
    }
    case Dimension::FlopRate:
    case Dimension::Flops: {
      std::string_view v = u;
      double p = take_prefix(v, false, false);
      std::string rest(v);
      for (auto& c : rest) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      if (d == Dimension::FlopRate) {
        if (rest == "FLOP/S" || rest == "FLOPS" || rest == "FLOPS/S") return p;
      } else {
        if (rest == "FLOP" || rest == "FLOPS") return p;
      }
      return std::nullopt;
    }
    case Dimension::Power: {
      std::string_view v = u;
      if (v == "W" || v == "watt" || v == "watts") return 1;
      if (v == "kW") return 1e3;
      return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<double> parse_quantity(const std::string& text, Dimension d) {
  std::string s = trim(text);
  if (s.empty()) return std::nullopt;
  const char* begin = s.c_str();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(begin, &end);
  if (end == begin || errno == ERANGE || !std::isfinite(v)) return std::nullopt;
  // strtod accepts "inf", "nan", hex: only plain decimal numbers are quantities here.
  for (const char* c = begin; c < end; ++c)
    if (!(std::isdigit(static_cast<unsigned char>(*c)) || *c == '.' || *c == 'e' || *c == 'E' || *c == '+' || *c == '-'))
      return std::nullopt;
  auto f = unit_factor(trim(std::string_view(end)), d);
  if (!f) return std::nullopt;
  return v * *f;
}

}  // namespace dssim
