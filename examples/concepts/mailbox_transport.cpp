// docs/concepts.md's point-to-point transport: ranks are threads of one process, and a send copies its bytes into a
// mailbox (so it completes at once) from which a matching recv takes them. Four ranks run collectives through it.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include <shardkit/comm/p2p_communicator.hpp>
#include <shardkit/comm/process_group.hpp>

namespace sk = shardkit;

class mailbox_transport {
 public:
  using transport_concept = sk::transport::p2p_tag;

  struct world {  // what the ranks share
    explicit world(int n) : gone(std::size_t(n), false) {}
    using key = std::tuple<int, int, sk::transport::message_tag>;  // (to, from, tag): one FIFO each
    struct posted_recv {
      std::span<std::byte> into;
      sk::completion_source done;
    };
    std::mutex mutex;
    std::map<key, std::deque<std::vector<std::byte>>> messages;  // sent, not yet received
    std::map<key, std::deque<posted_recv>> recvs;                // posted, nothing arrived yet
    std::vector<bool> gone;
  };

  mailbox_transport(std::shared_ptr<world> w, int rank) : world_(std::move(w)), rank_(rank) {}
  ~mailbox_transport() { leave(); }

  int rank() const { return rank_; }
  int size() const { return int(world_->gone.size()); }

  sk::completion send(int peer, sk::transport::message_tag tag, std::span<const std::byte> bytes) {
    std::unique_lock lock(world_->mutex);
    if (world_->gone[std::size_t(peer)]) return lost(peer, "send");
    const world::key k{peer, rank_, tag};
    auto waiting = world_->recvs.find(k);
    if (waiting == world_->recvs.end()) {
      world_->messages[k].emplace_back(bytes.begin(), bytes.end());
      return sk::completion::ready(bytes.size());
    }
    world::posted_recv r = std::move(waiting->second.front());
    waiting->second.pop_front();
    if (waiting->second.empty()) world_->recvs.erase(waiting);
    lock.unlock();  // completing runs continuations, which may call back into this transport
    deliver(bytes, r, peer);
    return sk::completion::ready(bytes.size());
  }

  sk::completion recv(int peer, sk::transport::message_tag tag, std::span<std::byte> into) {
    world::posted_recv r{into, {}};
    std::unique_lock lock(world_->mutex);
    const world::key k{rank_, peer, tag};
    auto queued = world_->messages.find(k);
    if (queued == world_->messages.end()) {
      if (world_->gone[std::size_t(peer)]) return lost(peer, "recv");
      r.done.on_cancel([w = std::weak_ptr(world_), k, done = r.done, peer, me = rank_] {
        auto hub = w.lock();
        if (!hub) return false;
        {
          std::lock_guard guard(hub->mutex);
          auto q = hub->recvs.find(k);
          if (q == hub->recvs.end()) return false;
          auto pos = std::ranges::find_if(q->second, [&](const auto& p) { return p.done == done; });
          if (pos == q->second.end()) return false;  // already matched
          q->second.erase(pos);
          if (q->second.empty()) hub->recvs.erase(q);
        }
        done.set_error(sk::error(sk::errc::aborted, "recv cancelled", {.rank = me, .peer = peer, .operation = "recv"}));
        return true;
      });
      world_->recvs[k].push_back(r);
      return r.done;
    }
    std::vector<std::byte> message = std::move(queued->second.front());
    queued->second.pop_front();
    if (queued->second.empty()) world_->messages.erase(queued);
    lock.unlock();
    deliver(message, r, peer);
    return r.done;
  }

 private:
  void deliver(std::span<const std::byte> message, const world::posted_recv& r, int peer) const {
    if (message.size() > r.into.size())
      return r.done.set_error(sk::error(sk::errc::protocol,
                                        "a message of " + std::to_string(message.size()) + " bytes for a recv of " +
                                            std::to_string(r.into.size()),
                                        {.rank = rank_, .peer = peer, .operation = "recv"}));
    std::memcpy(r.into.data(), message.data(), message.size());
    r.done.set_done(message.size());
  }

  sk::completion lost(int peer, const char* op) const {
    return sk::completion::failed(std::make_exception_ptr(
        sk::error(sk::errc::peer_lost, "rank " + std::to_string(peer) + " left", {.rank = rank_, .peer = peer, .operation = op})));
  }

  // This rank leaves: recvs posted from it (by peers) fail with peer_lost, and so do its own.
  void leave() {
    std::vector<std::pair<world::posted_recv, int>> failed;
    {
      std::lock_guard lock(world_->mutex);
      world_->gone[std::size_t(rank_)] = true;
      std::erase_if(world_->recvs, [&](auto& entry) {
        const auto [to, from, tag] = entry.first;
        if (to != rank_ && from != rank_) return false;
        for (auto& r : entry.second) failed.emplace_back(std::move(r), to == rank_ ? from : rank_);
        return true;
      });
    }
    for (auto& [r, peer] : failed)
      r.done.set_error(sk::error(sk::errc::peer_lost, "rank " + std::to_string(peer) + " left", {.peer = peer, .operation = "recv"}));
  }

  std::shared_ptr<world> world_;
  int rank_;
};
static_assert(sk::transport::p2p<mailbox_transport>);

int main() {
  constexpr int n = 4;
  auto shared = std::make_shared<mailbox_transport::world>(n);
  std::atomic<int> wrong{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      auto pg = sk::comm::process_group::create(
          sk::comm::p2p_communicator<mailbox_transport>(std::make_shared<mailbox_transport>(shared, r)));
      // 1 Mi floats goes round the ring, 16 by recursive doubling: the generic algorithms over this transport.
      for (std::size_t count : {std::size_t(16), std::size_t(1) << 20}) {
        std::vector<float> x(count, float(r + 1));
        pg.all_reduce(sk::buffer_view(std::span<float>(x))).wait();
        wrong += std::ranges::count_if(x, [](float v) { return v != n * (n + 1) / 2; });
      }
      std::vector<int> mine{r, -r}, all(2 * n);
      pg.all_gather(sk::const_buffer_view(std::span<const int>(mine)), sk::buffer_view(std::span<int>(all))).wait();
      for (int i = 0; i < n; ++i) wrong += all[2 * std::size_t(i)] != i || all[2 * std::size_t(i) + 1] != -i;
    });
  for (auto& t : ranks) t.join();

  // A peer that leaves fails what is posted with it, naming it.
  auto pair = std::make_shared<mailbox_transport::world>(2);
  auto a = std::make_shared<mailbox_transport>(pair, 0);
  auto b = std::make_shared<mailbox_transport>(pair, 1);
  std::byte buf[8];
  sk::completion pending = a->recv(1, 7, buf);
  b.reset();
  try {
    pending.wait();
    ++wrong;
  } catch (const sk::error& e) {
    wrong += e.code() != sk::errc::peer_lost || e.context().peer != 1;
  }
  std::printf("%s: %d wrong results\n", wrong ? "FAIL" : "OK", wrong.load());
  return wrong ? 1 : 0;
}
