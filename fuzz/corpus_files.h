// Reads a fuzz target's checked-in inputs (fuzz/seeds/<target>/, built from text
// protos, and fuzz/regressions/<target>/, inputs that once failed) for the replay test
// and the standalone driver.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace kvagent::fuzz {

// (path, bytes) of every regular file under each of `paths` (files or folders,
// recursively, symlinks followed), sorted by path. Missing paths are skipped.
std::vector<std::pair<std::string, std::string>> ReadInputs(const std::vector<std::string>& paths);

}  // namespace kvagent::fuzz
