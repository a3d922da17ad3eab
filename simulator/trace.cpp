#include "simulator/trace.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <stdexcept>

namespace dssim::sim {

std::string slice_name(const Program& program, const Instruction& in) {
  std::string s = to_string(in.op);
  if (in.purpose != Purpose::None) { s += ' '; s += to_string(in.purpose); }
  if (in.micro_batch >= 0) s += " mb" + std::to_string(in.micro_batch);
  if (in.bucket >= 0) s += " b" + std::to_string(in.bucket);
  return s;
}

namespace {
void put_json_string(std::FILE* f, const std::string& s) {
  std::fputc('"', f);
  for (char c : s) {
    if (c == '"' || c == '\\') { std::fputc('\\', f); std::fputc(c, f); }
    else if (static_cast<unsigned char>(c) < 0x20) std::fprintf(f, "\\u%04x", c);
    else std::fputc(c, f);
  }
  std::fputc('"', f);
}
void put_us(std::FILE* f, long long ns) { std::fprintf(f, "%lld.%03lld", ns / 1000, ns % 1000); }
}  // namespace

void write_chrome_trace(const std::string& path, const Program& program, const std::vector<int>& ranks,
                        const std::vector<int>& templates, const std::vector<std::vector<Span>>& spans,
                        const std::vector<int>& only) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write trace " + path);
  const std::set<int> keep(only.begin(), only.end());
  std::fputs("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n", f);
  bool first = true;
  auto sep = [&] { if (!first) std::fputs(",\n", f); first = false; };
  for (size_t k = 0; k < ranks.size(); ++k) {
    const int rank = ranks[k];
    if (!keep.empty() && !keep.count(rank)) continue;
    sep();
    std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}", rank, rank);
    sep();
    std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"args\":{\"sort_index\":%d}}", rank, rank);
    for (int s = 0; s < kStreams; ++s) {
      sep();
      std::fprintf(f, "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}}",
                   rank, s, to_string(static_cast<Stream>(s)));
    }
    const RankProgram& rp = program.ranks.at(templates[k]);
    for (size_t i = 0; i < rp.instructions.size(); ++i) {
      const Instruction& in = rp.instructions[i];
      const Span& sp = spans[k][i];
      const long long t0 = std::llround(sp.start * 1e9), t1 = std::llround(sp.end * 1e9);
      sep();
      std::fputs("{\"ph\":\"X\",\"name\":", f);
      put_json_string(f, slice_name(program, in));
      std::fprintf(f, ",\"cat\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":", to_string(in.op), rank, int(in.stream));
      put_us(f, t0);
      std::fputs(",\"dur\":", f);
      put_us(f, std::max(0LL, t1 - t0));
      std::fprintf(f, ",\"args\":{\"index\":%zu,\"purpose\":\"%s\",\"micro_batch\":%d,\"repeat\":%d,"
                      "\"bytes\":%.17g,\"flops\":%.17g",
                   i, to_string(in.purpose), in.micro_batch, in.repeat, in.bytes, in.flops);
      if (in.group >= 0 && in.group < static_cast<int>(program.groups.size()))
        std::fprintf(f, ",\"group\":\"%s\"", to_string(program.groups[in.group].kind));
      if (in.peer >= 0) std::fprintf(f, ",\"peer\":%d", in.peer);
      if (in.layer_count > 0) std::fprintf(f, ",\"layers\":\"%d-%d\"", in.layer_begin, in.layer_begin + in.layer_count - 1);
      std::fputs("}}", f);
    }
  }
  std::fputs("\n]}\n", f);
  if (std::fclose(f) != 0) throw std::runtime_error("error writing trace " + path);
}

}  // namespace dssim::sim
