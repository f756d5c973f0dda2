// The whole text of a file, for the small /proc and /sys files the agent reads.
#pragma once

#include <optional>
#include <string>

namespace kvagent {

// The file's contents; nullopt when it cannot be opened.
std::optional<std::string> ReadFileText(const std::string& path);

}  // namespace kvagent
