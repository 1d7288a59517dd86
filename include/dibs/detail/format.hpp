// dibs/detail/format.hpp: every public enum of dibs that has a to_string()
// prints by name, through fmt and through std::ostream:
//
//   fmt::print("{}\n", status.state);   // "processing"
//   std::cout << dibs::jitter::full;    // "full"
#pragma once

#include <concepts>
#include <ostream>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

namespace dibs::detail {

template <class E>
concept named_enum = std::is_enum_v<E> && requires(E e) {
  { to_string(e) } -> std::convertible_to<const char*>;
};

}  // namespace dibs::detail

namespace dibs {

template <detail::named_enum E>
std::ostream& operator<<(std::ostream& out, E e) {
  return out << to_string(e);
}

}  // namespace dibs

template <dibs::detail::named_enum E>
struct fmt::formatter<E, char> : fmt::formatter<std::string_view, char> {
  template <class Context>
  auto format(E e, Context& ctx) const {
    return fmt::formatter<std::string_view, char>::format(to_string(e), ctx);
  }
};
