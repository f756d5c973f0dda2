#include "fuzz/corpus_files.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace kvagent::fuzz {

std::vector<std::pair<std::string, std::string>> ReadInputs(const std::vector<std::string>& paths) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  for (const std::string& path : paths) {
    std::error_code ec;
    if (fs::is_regular_file(path, ec)) {
      files.push_back(path);
      continue;
    }
    if (!fs::is_directory(path, ec)) continue;
    for (fs::recursive_directory_iterator it(
             path, fs::directory_options::follow_directory_symlink, ec), end;
         !ec && it != end; it.increment(ec)) {
      if (fs::is_regular_file(it->path(), ec)) files.push_back(it->path().string());
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream bytes;
    bytes << in.rdbuf();
    out.emplace_back(file, bytes.str());
  }
  return out;
}

}  // namespace kvagent::fuzz
