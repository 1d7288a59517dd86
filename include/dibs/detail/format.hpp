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

namespace dibs::detail {

/// What fmt prints a dibs name with (an enum's, a holder's, a claim's
/// status): the name, aligned in a field as with a string ("{:<12}",
/// "{:*>8}", "{:^10}"). Its own parsing of that spec, not fmt's string
/// formatter's: with fmt 9 and GCC 12 at -O3, that one, inlined into a
/// user's code, warns (-Wstringop-overflow) in programs built with -Werror.
struct name_formatter {
  char fill = ' ';
  char align = '<';
  std::size_t width = 0;

  constexpr auto parse(fmt::format_parse_context& ctx) {
    auto it = ctx.begin();
    const auto end = ctx.end();
    const auto is_align = [](char c) { return c == '<' || c == '>' || c == '^'; };
    if (it != end && it + 1 != end && is_align(it[1]) && *it != '{' && *it != '}') {
      fill = *it;
      align = it[1];
      it += 2;
    } else if (it != end && is_align(*it)) {
      align = *it++;
    }
    for (; it != end && *it >= '0' && *it <= '9'; ++it) width = width * 10 + static_cast<std::size_t>(*it - '0');
    if (it != end && *it != '}') throw fmt::format_error("dibs: a name takes only fill, alignment and width");
    return it;
  }

  template <class Context>
  auto write(std::string_view name, Context& ctx) const {
    const std::size_t pad = width > name.size() ? width - name.size() : 0;
    const std::size_t before = align == '>' ? pad : align == '^' ? pad / 2 : 0;
    auto out = ctx.out();
    for (std::size_t i = 0; i < before; ++i) *out++ = fill;
    for (const char c : name) *out++ = c;
    for (std::size_t i = before; i < pad; ++i) *out++ = fill;
    return out;
  }
};

}  // namespace dibs::detail

template <dibs::detail::named_enum E>
struct fmt::formatter<E, char> : dibs::detail::name_formatter {
  template <class Context>
  auto format(E e, Context& ctx) const {
    return write(to_string(e), ctx);
  }
};
