#include "base/file_text.h"

#include <fstream>
#include <sstream>

namespace kvagent {

std::optional<std::string> ReadFileText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace kvagent
