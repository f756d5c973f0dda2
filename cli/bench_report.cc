#include "cli/bench_report.h"

#include <optional>

#include "base/format.h"
#include "cli/bench_fast.h"
#include "fmt/format.h"

namespace kvagent::cli {
namespace {

constexpr const char* kHeader =
    "{:<5} {:<10} {:>5} {:>5} {:>6} {:>7} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} "
    "{:>6} {:>6} {:>7} {:>6} {:>6} {} {:>3} {}";

std::string Opt(const std::optional<double>& v, const char* format = "{:.3f}") {
  return v ? fmt::format(fmt::runtime(format), *v) : "null";
}

std::optional<double> Ratio(double num, const std::optional<double>& den) {
  if (!den || *den <= 0) return std::nullopt;
  return num / *den;
}

std::string Cellf(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : "-";
}

}  // namespace

std::string TableHeader() {
  return fmt::format(fmt::runtime(kHeader), "op", "pattern", "block", "batch", "xfers", "GB/s",
                     "xfer/s", "avg_us", "p50_us", "p99_us", "ntf_p50", "ntf_p99", "pt_GB/s",
                     "mc_GB/s", "x_pt", "x_mc", "GB/s@4", "x_pt@4", "x_mc@4", FastCellHeader(),
                     "ok", "path");
}

std::string TableLine(const CellResult& r) {
  return fmt::format(fmt::runtime(kHeader), v1::TransferOp_Name(r.cell.op),
                     r.cell.scattered ? "scattered" : "contig", SizeName(r.cell.block), r.cell.batch,
                     r.transfers, fmt::format("{:.2f}", r.gbps),
                     fmt::format("{:.0f}", r.transfers_per_s), fmt::format("{:.0f}", r.avg_us),
                     fmt::format("{:.0f}", r.p50_us), fmt::format("{:.0f}", r.p99_us),
                     Cellf(r.notify_p50_us, "{:.0f}"), Cellf(r.notify_p99_us, "{:.0f}"),
                     Cellf(r.perftest_gbps, "{:.2f}"), Cellf(r.memcpy_gbps, "{:.2f}"),
                     Cellf(Ratio(r.gbps, r.perftest_gbps), "{:.2f}"),
                     Cellf(Ratio(r.gbps, r.memcpy_gbps), "{:.2f}"),
                     fmt::format("{:.2f}", r.gbps_inflight),
                     Cellf(Ratio(r.gbps_inflight, r.perftest_gbps), "{:.2f}"),
                     Cellf(Ratio(r.gbps_inflight, r.memcpy_gbps), "{:.2f}"),
                     FastCellColumns(r.fast, r.perftest_gbps, r.memcpy_gbps),
                     r.verified ? "yes" : "NO", r.data_path);
}

std::string JsonLine(const CellResult& r) {
  return fmt::format(
      "{{\"kind\": \"cell\", \"op\": \"{}\", \"pattern\": \"{}\", \"block_bytes\": {}, \"batch\": {}, "
      "\"transfers\": {}, \"gbps\": {:.3f}, \"transfers_per_s\": {:.1f}, \"avg_us\": {:.1f}, "
      "\"p50_us\": {:.1f}, \"p99_us\": {:.1f}, \"notify_p50_us\": {}, \"notify_p99_us\": {}, "
      "\"perftest_gbps\": {}, \"memcpy_gbps\": {}, \"ratio_perftest\": {}, \"ratio_memcpy\": {}, "
      "\"gbps_inflight4\": {:.3f}, \"ratio_perftest_inflight4\": {}, \"ratio_memcpy_inflight4\": {}, "
      "\"data_path\": \"{}\", \"runs\": {}, \"verified\": {}{}}}",
      v1::TransferOp_Name(r.cell.op), r.cell.scattered ? "scattered" : "contiguous", r.cell.block,
      r.cell.batch, r.transfers, r.gbps, r.transfers_per_s, r.avg_us, r.p50_us, r.p99_us,
      Opt(r.notify_p50_us, "{:.1f}"), Opt(r.notify_p99_us, "{:.1f}"), Opt(r.perftest_gbps),
      Opt(r.memcpy_gbps), Opt(Ratio(r.gbps, r.perftest_gbps)), Opt(Ratio(r.gbps, r.memcpy_gbps)),
      r.gbps_inflight, Opt(Ratio(r.gbps_inflight, r.perftest_gbps)),
      Opt(Ratio(r.gbps_inflight, r.memcpy_gbps)), r.data_path, r.runs,
      r.verified ? "true" : "false", FastCellJson(r.fast, r.perftest_gbps, r.memcpy_gbps));
}

}  // namespace kvagent::cli
