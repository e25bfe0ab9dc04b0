// Reads the parity fixtures written by tests/parity/make_fixtures.py.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace conveyor::testing {

struct FixtureCase {
  std::string name;
  std::map<std::string, std::string> params;
  std::vector<std::string> results;  // the '|'-separated fields after the params
  int line = 0;

  const std::string& param(const std::string& key) const {
    auto it = params.find(key);
    if (it == params.end()) throw std::runtime_error("fixture line " + std::to_string(line) + " lacks " + key);
    return it->second;
  }
  int64_t integer(const std::string& key) const { return std::stoll(param(key)); }
  uint64_t unsigned_integer(const std::string& key) const { return std::stoull(param(key)); }
  std::string describe() const {
    std::string text = name + " (line " + std::to_string(line) + ")";
    for (const auto& [k, v] : params) text += " " + k + "=" + v;
    return text;
  }
};

inline std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, separator)) parts.push_back(part);
  if (!text.empty() && text.back() == separator) parts.emplace_back();
  return parts;
}

template <class T>
std::vector<T> numbers(const std::string& text) {
  std::vector<T> out;
  std::istringstream in(text);
  T value;
  while (in >> value) out.push_back(value);
  return out;
}

// "1 2,3 4" -> {{1,2},{3,4}}
template <class T>
std::vector<std::vector<T>> number_lists(const std::string& text) {
  std::vector<std::vector<T>> out;
  if (text.empty()) return out;
  for (const std::string& part : split(text, ',')) out.push_back(numbers<T>(part));
  return out;
}

inline std::vector<FixtureCase> load_fixtures(const std::string& file, const std::string& only = "") {
  std::ifstream in(std::string(CONVEYOR_FIXTURE_DIR) + "/" + file);
  if (!in) throw std::runtime_error("cannot open fixture file " + file);
  std::vector<FixtureCase> cases;
  std::string text;
  int line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (text.empty() || text[0] == '#') continue;
    std::vector<std::string> fields = split(text, '|');
    FixtureCase c;
    c.line = line;
    c.name = fields.at(0);
    if (!only.empty() && c.name != only) continue;
    for (const std::string& kv : split(fields.at(1), ';')) {
      const auto eq = kv.find('=');
      c.params[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    c.results.assign(fields.begin() + 2, fields.end());
    if (c.results.empty()) c.results.emplace_back();
    cases.push_back(std::move(c));
  }
  return cases;
}

}  // namespace conveyor::testing
