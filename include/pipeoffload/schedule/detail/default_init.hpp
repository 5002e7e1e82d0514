// pipeoffload/schedule/detail/default_init.hpp: vectors whose resize() writes nothing.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace pipeoffload::detail {

/// std::allocator whose resize() leaves new entries unwritten at run time (value-initialized
/// in a constant expression): for scratch arrays each of whose entries is written before it
/// is read, so that sizing them costs no pass over their memory.
template <class T>
struct default_init : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = default_init<U>;
  };
  constexpr default_init() noexcept = default;
  template <class U>
  constexpr default_init(const default_init<U>&) noexcept {}
  template <class U>
  constexpr void construct(U* p) noexcept {
    if (std::is_constant_evaluated())
      std::construct_at(p);
    else
      ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  constexpr void construct(U* p, A&&... a) {
    std::construct_at(p, std::forward<A>(a)...);
  }
};

}  // namespace pipeoffload::detail
