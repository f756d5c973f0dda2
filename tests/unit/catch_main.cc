// Catch2 main for every kvagent test target. Catch2 2.13 runs one reporter per run, so
// the console reporter keeps stdout as usual (what `bazel test --test_output=errors`
// shows) and a listener writes JUnit XML to $XML_OUTPUT_FILE, which Bazel sets, so
// .ci/count_tests.py counts test cases rather than targets. One <testcase> per
// TEST_CASE; a failure carries every failed assertion's location and expansion; a case
// that called KVAGENT_SKIP gets <skipped message="reason"/>.
#define CATCH_CONFIG_MAIN
#include "tests/unit/catch_main.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace kvagent {
namespace testing {
namespace {

// Set by Skip() inside the running test case, cleared when the next one starts.
std::string& SkipReason() {
  static std::string reason;
  return reason;
}
bool& SkipCalled() {
  static bool called = false;
  return called;
}

struct ShownFile {
  std::string path;
  std::string label;
  int lines;
};
std::vector<ShownFile>& ShownOnFailure() {
  static std::vector<ShownFile> files;
  return files;
}

// The last `lines` lines of `path`, each cut at 400 bytes (a log line can carry a
// whole doctor report).
void PrintTail(const ShownFile& f) {
  std::ifstream in(f.path);
  if (!in) {
    std::cerr << "---- " << f.label << " (" << f.path << "): cannot be read\n";
    return;
  }
  std::vector<std::string> tail;
  std::string line;
  size_t total = 0;
  while (std::getline(in, line)) {
    ++total;
    if (line.size() > 400) line = line.substr(0, 400) + " [...]";
    tail.push_back(std::move(line));
    if (tail.size() > static_cast<size_t>(f.lines)) tail.erase(tail.begin());
  }
  std::cerr << "---- " << f.label << " (" << f.path << "), last " << tail.size() << " of "
            << total << " lines:\n";
  for (const std::string& l : tail) std::cerr << l << "\n";
}

std::string XmlEscape(const std::string& in) {
  std::string out;
  out.reserve(in.size());
  for (char c : in) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // XML 1.0 forbids most control characters even escaped; tests print bytes.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t' && c != '\r') {
          out += '?';
        } else {
          out += c;
        }
    }
  }
  return out;
}

struct CaseResult {
  std::string name;
  double seconds = 0;
  bool failed = false;
  bool skipped = false;
  std::string skip_reason;
  std::string failure_text;  // every failed assertion, one block each
};

class JunitFileListener : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;

  void testCaseStarting(Catch::TestCaseInfo const& info) override {
    TestEventListenerBase::testCaseStarting(info);
    SkipCalled() = false;
    SkipReason().clear();
    ShownOnFailure().clear();
    current_ = CaseResult{};
    current_.name = info.name;
    started_ = std::chrono::steady_clock::now();
  }

  bool assertionEnded(Catch::AssertionStats const& stats) override {
    const Catch::AssertionResult& r = stats.assertionResult;
    if (!r.isOk()) {
      std::ostringstream text;
      text << r.getSourceInfo().file << ":" << r.getSourceInfo().line << ":";
      if (r.hasExpression()) {
        text << " " << r.getExpressionInMacro() << " with expansion "
             << r.getExpandedExpression();
      }
      if (r.hasMessage()) text << " " << r.getMessage();
      for (const Catch::MessageInfo& info : stats.infoMessages) {
        text << "\n  with message: " << info.message;
      }
      current_.failure_text += text.str() + "\n";
    }
    return true;
  }

  void testCaseEnded(Catch::TestCaseStats const& stats) override {
    current_.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
    current_.failed = stats.totals.testCases.failed > 0;
    current_.skipped = !current_.failed && SkipCalled();
    current_.skip_reason = SkipReason();
    results_.push_back(current_);
    if (current_.failed) {
      for (const ShownFile& f : ShownOnFailure()) PrintTail(f);
    }
    ShownOnFailure().clear();
    TestEventListenerBase::testCaseEnded(stats);
  }

  // Also reached after a fatal signal (Catch2 ends the run before re-raising), so a
  // crash still leaves XML that names the crashing case as failed.
  void testRunEnded(Catch::TestRunStats const& stats) override {
    TestEventListenerBase::testRunEnded(stats);
    const char* path = std::getenv("XML_OUTPUT_FILE");
    if (path == nullptr || *path == '\0') return;
    WriteXml(path);
  }

 private:
  void WriteXml(const std::string& path) const {
    const char* target_env = std::getenv("TEST_TARGET");
    const std::string suite = target_env != nullptr ? target_env : "catch2";
    int failures = 0, skipped = 0;
    double total = 0;
    for (const CaseResult& c : results_) {
      failures += c.failed ? 1 : 0;
      skipped += c.skipped ? 1 : 0;
      total += c.seconds;
    }
    const std::string tmp = path + ".tmp";
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) {
      std::cerr << "catch_main: cannot write JUnit XML to " << tmp
                << "; check that the directory in XML_OUTPUT_FILE exists and is writable\n";
      return;
    }
    out << std::fixed << std::setprecision(6);
    out << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n"
        << "  <testsuite name=\"" << XmlEscape(suite) << "\" tests=\"" << results_.size()
        << "\" failures=\"" << failures << "\" errors=\"0\" skipped=\"" << skipped
        << "\" time=\"" << total << "\">\n";
    for (const CaseResult& c : results_) {
      out << "    <testcase classname=\"" << XmlEscape(suite) << "\" name=\""
          << XmlEscape(c.name) << "\" time=\"" << c.seconds << "\"";
      if (c.failed) {
        out << ">\n      <failure message=\"test case failed\">" << XmlEscape(c.failure_text)
            << "</failure>\n    </testcase>\n";
      } else if (c.skipped) {
        out << ">\n      <skipped message=\"" << XmlEscape(c.skip_reason)
            << "\"/>\n    </testcase>\n";
      } else {
        out << "/>\n";
      }
    }
    out << "  </testsuite>\n</testsuites>\n";
    out.close();
    if (!out || std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::cerr << "catch_main: failed to write JUnit XML " << path << "\n";
    }
  }

  CaseResult current_;
  std::chrono::steady_clock::time_point started_;
  std::vector<CaseResult> results_;
};

CATCH_REGISTER_LISTENER(JunitFileListener)

}  // namespace

std::string UniqueSocketName(const std::string& prefix) {
  std::ostringstream name;
  name << prefix << '.' << ::getpid() << '.' << std::hex << std::setw(8) << std::setfill('0')
       << std::random_device{}();
  return name.str();
}

void ShowOnFailure(const std::string& path, const std::string& label, int lines) {
  ShownOnFailure().push_back(ShownFile{path, label, lines});
}

void Skip(const std::string& reason) {
  SkipCalled() = true;
  SkipReason() = reason;
  std::cout << "SKIPPED: " << reason << std::endl;
}

}  // namespace testing
}  // namespace kvagent
