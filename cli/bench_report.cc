#include "cli/bench_report.h"

#include <optional>
#include <string>
#include <vector>

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

// A TimeSplit's fields (", \"paired_<kind>timelines\": ..."), null where no timeline was
// read.
std::string SplitJson(const char* kind, const TimeSplit& t) {
  auto known = [&t](double v) { return t.timelines > 0 ? std::optional<double>(v) : std::nullopt; };
  return fmt::format(
      ", \"paired_{0}timelines\": {1}, \"paired_{0}agent_p50_us\": {2}, "
      "\"paired_{0}before_copy_p50_us\": {3}, \"paired_{0}copy_p50_us\": {4}, "
      "\"paired_{0}receiver_p50_us\": {5}, \"paired_{0}ring_p50_us\": {6}",
      kind, t.timelines, Opt(known(t.agent_p50_us), "{:.1f}"),
      Opt(known(t.before_copy_p50_us), "{:.1f}"), Opt(known(t.copy_p50_us), "{:.1f}"),
      Opt(known(t.receiver_p50_us), "{:.1f}"), Opt(known(t.ring_p50_us), "{:.1f}"));
}

// The cell's paired fields (", \"paired_rounds\": ..."), null without paired rounds.
std::string PairedJson(const std::optional<PairedCell>& p) {
  if (!p) {
    return ", \"paired_rounds\": 0, \"paired_memcpy_p50_us\": null, "
           "\"paired_contiguous_p50_us\": null, \"paired_scattered_p50_us\": null, "
           "\"paired_fast_over_memcpy\": null, \"paired_fast_over_memcpy_q1\": null, "
           "\"paired_fast_over_memcpy_q3\": null, \"paired_scattered_over_contiguous\": null, "
           "\"paired_scattered_over_contiguous_q1\": null, "
           "\"paired_scattered_over_contiguous_q3\": null, \"paired_placed_rounds\": 0, "
           "\"paired_placed_p50_us\": null, \"paired_placed_over_memcpy\": null, "
           "\"paired_memcpy_scattered_p50_us\": null, "
           "\"paired_memcpy_scattered_over_contiguous\": null, "
           "\"paired_memcpy_scattered_over_contiguous_q1\": null, "
           "\"paired_memcpy_scattered_over_contiguous_q3\": null" +
           SplitJson("", TimeSplit{}) + SplitJson("scattered_", TimeSplit{});
  }
  // The placed and timeline figures: null where the paired rounds did not measure them.
  const bool placed = p->placed_rounds > 0;
  auto known = [](bool measured, double v) {
    return measured ? std::optional<double>(v) : std::nullopt;
  };
  return fmt::format(
      ", \"paired_rounds\": {}, \"paired_memcpy_p50_us\": {:.1f}, "
      "\"paired_contiguous_p50_us\": {:.1f}, \"paired_scattered_p50_us\": {:.1f}, "
      "\"paired_fast_over_memcpy\": {:.3f}, \"paired_fast_over_memcpy_q1\": {:.3f}, "
      "\"paired_fast_over_memcpy_q3\": {:.3f}, \"paired_scattered_over_contiguous\": {:.3f}, "
      "\"paired_scattered_over_contiguous_q1\": {:.3f}, "
      "\"paired_scattered_over_contiguous_q3\": {:.3f}, \"paired_placed_rounds\": {}, "
      "\"paired_placed_p50_us\": {}, \"paired_placed_over_memcpy\": {}, "
      "\"paired_memcpy_scattered_p50_us\": {:.1f}, "
      "\"paired_memcpy_scattered_over_contiguous\": {:.3f}, "
      "\"paired_memcpy_scattered_over_contiguous_q1\": {:.3f}, "
      "\"paired_memcpy_scattered_over_contiguous_q3\": {:.3f}{}{}",
      p->rounds, p->memcpy_p50_us, p->contiguous_p50_us, p->scattered_p50_us,
      p->fast_over_memcpy.of_medians, p->fast_over_memcpy.q1, p->fast_over_memcpy.q3,
      p->scattered_over_contiguous.of_medians, p->scattered_over_contiguous.q1,
      p->scattered_over_contiguous.q3, p->placed_rounds,
      Opt(known(placed, p->placed_p50_us), "{:.1f}"),
      Opt(known(placed, p->placed_over_memcpy.of_medians), "{:.3f}"),
      p->memcpy_scattered_p50_us, p->memcpy_scattered_over_contiguous.of_medians,
      p->memcpy_scattered_over_contiguous.q1, p->memcpy_scattered_over_contiguous.q3,
      SplitJson("", p->contiguous_split), SplitJson("scattered_", p->scattered_split));
}

std::string RatioText(const PairedRatio& r) {
  return fmt::format("{:.2f} [{:.2f}-{:.2f}]", r.of_medians, r.q1, r.q3);
}

std::string CellName(const Cell& c) {
  return fmt::format("{} {} x {}", v1::TransferOp_Name(c.op), SizeName(c.block), c.batch);
}

}  // namespace

bool FastOverMemcpyTarget(uint64_t block, uint32_t batch) {
  return block >= (64 << 10) && batch >= 16;
}

bool ScatteredTarget(uint64_t block, uint32_t batch) {
  return block >= (64 << 10) && batch >= 64;
}

std::string PairedLine(const PairedCell& p) {
  std::string out = fmt::format(
      "      paired, {}, {} rounds from a cold cache: fast/memcpy {}, scattered/contiguous "
      "{} (memcpy of the same pieces {}) (p50 us: memcpy {:.0f}, of the scattered pieces "
      "{:.0f}; contiguous {:.0f}, scattered {:.0f})",
      CellName(p.cell), p.rounds, RatioText(p.fast_over_memcpy),
      RatioText(p.scattered_over_contiguous), RatioText(p.memcpy_scattered_over_contiguous),
      p.memcpy_p50_us, p.memcpy_scattered_p50_us, p.contiguous_p50_us, p.scattered_p50_us);
  if (p.placed_rounds > 0) {
    out += fmt::format("\n        completing when placed: fast/memcpy {} (p50 {:.0f} us)",
                       RatioText(p.placed_over_memcpy), p.placed_p50_us);
  } else {
    out += "\n        completing when placed: - (completed when acknowledged: the data path "
           "confirms placement only by the peer's acknowledgement, ucx-am or host staging, or "
           "the agent is older than complete_when)";
  }
  for (const auto& [name, t] : {std::pair{"contiguous", &p.contiguous_split},
                                 std::pair{"scattered", &p.scattered_split}}) {
    if (t->timelines == 0) continue;
    out += fmt::format(
        "\n        {}, where its time went (p50 us, {} timelines): in the agent {:.0f} (before "
        "the copy {:.0f}, the copy {:.0f}, the receiver's acknowledgement {:.0f}), between "
        "client and agent {:.0f} (the ring's pick-up and completion, with their wake-ups)",
        name, t->timelines, t->agent_p50_us, t->before_copy_p50_us, t->copy_p50_us,
        t->receiver_p50_us, t->ring_p50_us);
  }
  return out;
}

std::string TargetsBlock(const std::vector<PairedCell>& pairs, bool json,
                         std::optional<double> load_start, std::optional<double> load_now) {
  struct Target {
    const char* key;
    const char* text;
    double threshold;
    bool (*applies)(uint64_t, uint32_t);
    PairedRatio PairedCell::*ratio;
    bool placed = false;  // judged only on cells whose placed rounds ran
    // The bench's own memcpys on the same ratio, shown beside (not judged); null where
    // there is none.
    PairedRatio PairedCell::*memcpy_ratio = nullptr;
  };
  const Target targets[] = {
      {"fast_over_memcpy", "fast path >= cold memcpy of the same pages, from 64K x 16 up", 1.0,
       FastOverMemcpyTarget, &PairedCell::fast_over_memcpy},
      {"scattered_over_contiguous",
       "scattered within 10 % of contiguous (fast path), from 64K x 64 up", 0.9, ScatteredTarget,
       &PairedCell::scattered_over_contiguous, false,
       &PairedCell::memcpy_scattered_over_contiguous},
      {"fast_placed_over_memcpy",
       "the same completing when placed (COMPLETE_WHEN_PLACED), from 64K x 16 up", 1.0,
       FastOverMemcpyTarget, &PairedCell::placed_over_memcpy, true},
  };
  std::string out;
  if (!json) {
    out += fmt::format(
        "targets (issue 14; paired rounds: ratio of medians as speeds [interquartile range of "
        "the rounds' ratios]; load average {} at the sweep's start, {} now):\n",
        Cellf(load_start, "{:.2f}"), Cellf(load_now, "{:.2f}"));
  }
  for (const Target& t : targets) {
    std::string lines;
    uint64_t cells = 0, met = 0;
    for (const PairedCell& p : pairs) {
      if (!t.applies(p.cell.block, p.cell.batch)) continue;
      if (t.placed && p.placed_rounds == 0) continue;
      const uint64_t rounds = t.placed ? p.placed_rounds : p.rounds;
      const PairedRatio& r = p.*t.ratio;
      const bool ok = r.of_medians >= t.threshold;
      ++cells;
      met += ok ? 1 : 0;
      if (json) {
        lines += fmt::format(
            "{{\"kind\": \"target\", \"issue\": 14, \"target\": \"{}\", \"op\": \"{}\", "
            "\"block_bytes\": {}, \"batch\": {}, \"rounds\": {}, \"ratio\": {:.3f}, "
            "\"q1\": {:.3f}, \"q3\": {:.3f}, \"threshold\": {:.2f}, \"met\": {}, "
            "\"memcpy_ratio\": {}, \"loadavg_1m\": {}}}\n",
            t.key, v1::TransferOp_Name(p.cell.op), p.cell.block, p.cell.batch, rounds,
            r.of_medians, r.q1, r.q3, t.threshold, ok ? "true" : "false",
            t.memcpy_ratio ? fmt::format("{:.3f}", (p.*t.memcpy_ratio).of_medians) : "null",
            Opt(load_now, "{:.2f}"));
      } else {
        lines += fmt::format(
            "    {:<16} {}, {} rounds: {}{}\n", CellName(p.cell), RatioText(r), rounds,
            ok ? "met" : "NOT met",
            t.memcpy_ratio
                ? fmt::format(" (memcpy of the same pieces {})", RatioText(p.*t.memcpy_ratio))
                : "");
      }
    }
    if (json) {
      out += lines + fmt::format(
          "{{\"kind\": \"targets\", \"issue\": 14, \"target\": \"{}\", \"threshold\": {:.2f}, "
          "\"cells\": {}, \"met\": {}, \"loadavg_1m_start\": {}, \"loadavg_1m\": {}}}\n",
          t.key, t.threshold, cells, met, Opt(load_start, "{:.2f}"), Opt(load_now, "{:.2f}"));
    } else if (cells == 0) {
      out += fmt::format("  {} (>= {:.2f}): no paired cell in this run\n", t.text, t.threshold);
    } else {
      out += fmt::format("  {} (>= {:.2f}): met in {} of {} cells\n", t.text, t.threshold, met,
                         cells) + lines;
    }
  }
  return out;
}

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
      r.verified ? "true" : "false",
      FastCellJson(r.fast, r.perftest_gbps, r.memcpy_gbps) + PairedJson(r.paired));
}

}  // namespace kvagent::cli
