package gateway

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// slowRelay relays TCP connections to Redis, holding back every reply by
// a settable delay (commands reach Redis at once): a Redis that answers
// slower than a call's deadline (startSlowCommandRelay: the commands held
// back instead).
type slowRelay struct {
	ln    net.Listener
	delay atomic.Int64 // ns
	// sent counts the bytes relayed to Redis (the commands).
	sent  atomic.Int64
	done  chan struct{}
	mu    sync.Mutex
	conns []net.Conn
}

func startSlowRelay(t *testing.T) *slowRelay { return startRelay(t, false) }

// startSlowCommandRelay is startSlowRelay delaying the other way: the
// commands on their way to Redis (a write lands late), the replies not.
func startSlowCommandRelay(t *testing.T) *slowRelay { return startRelay(t, true) }

func startRelay(t *testing.T, commands bool) *slowRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r := &slowRelay{ln: ln, done: make(chan struct{})}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		_ = ln.Close()
		close(r.done)
		r.mu.Lock()
		for _, c := range r.conns {
			_ = c.Close()
		}
		r.mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", redisAddr)
			if err != nil {
				_ = c.Close()
				continue
			}
			r.mu.Lock()
			r.conns = append(r.conns, c, up)
			r.mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); r.pump(up, c, commands, true) }()
			go func() { defer wg.Done(); r.pump(c, up, !commands, false) }()
		}
	}()
	return r
}

func (r *slowRelay) addr() string { return r.ln.Addr().String() }

func (r *slowRelay) setDelay(d time.Duration) { r.delay.Store(int64(d)) }

// pump copies src to dst, each chunk held back by the delay current when
// it was read if delayed (order kept), then closes both; toRedis: src is
// the client (its bytes count in sent).
func (r *slowRelay) pump(dst, src net.Conn, delayed, toRedis bool) {
	defer func() { _ = dst.Close(); _ = src.Close() }()
	type chunk struct {
		b  []byte
		at time.Time
	}
	ch := make(chan chunk, 256)
	go func() {
		defer close(ch)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				if toRedis {
					r.sent.Add(int64(n))
				}
				c := chunk{b: buf[:n], at: time.Now()}
				if delayed {
					c.at = c.at.Add(time.Duration(r.delay.Load()))
				}
				select {
				case ch <- c:
				case <-r.done:
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range ch {
		select {
		case <-time.After(time.Until(c.at)):
		case <-r.done:
			return
		}
		if _, err := dst.Write(c.b); err != nil {
			return
		}
	}
}

// placement is where a new session s goes among d1 and d2 when both are
// idle (rendezvous of its id), and the other deployment.
func placement(s string) (placed, other string) {
	order, _ := routing.BoundedRendezvous(sessionKey(s), []routing.Loaded{{ID: "d1", Weight: 1}, {ID: "d2", Weight: 1}}, routing.DefaultLoadFactor)
	ids := [2]string{"d1", "d2"}
	return ids[order[0]], ids[order[1]]
}

// slowCallTimeout is the affinity call timeout of the tests whose Redis
// is slow only while a relay delays it: generous, so that a turn meant to
// be answered is answered on this loaded machine, and the relay's delay,
// three times as long, always exceeds it.
const slowCallTimeout = time.Second

// A lookup that times out (Redis slower than the affinity call deadline)
// leaves the session's pin unknown: the request is placed as a new
// session would be, on this proxy's own loads, and the pin is neither
// counted as missing nor overwritten, so once Redis answers in time the
// session is back on its pinned deployment. (Before: the unread pin
// counted as none, and the deployment that served the slow turn became
// the session's pin for good.)
func TestSlowLookupKeepsPin(t *testing.T) {
	relay := startSlowRelay(t)
	ae := newAffinityEnvVia(t, relay.addr(), slowCallTimeout, nil)
	const session = "slow-redis-session"
	placed, pinned := placement(session)
	require.NoError(t, ae.rdb.Set(context.Background(), ae.store.PinKey("o1", "g", session), pinned, time.Hour).Err())
	ev := ae.call(chatBody("g", ""), "x-session-id", session)
	require.Equal(t, pinned, ev.DeploymentId)
	require.Equal(t, reasonSession, ev.RoutingReason)

	relay.setDelay(3 * slowCallTimeout)
	const slow = 3
	for range slow {
		ev := ae.call(chatBody("g", ""), "x-session-id", session)
		require.Equal(t, placed, ev.DeploymentId, "a turn whose lookup timed out goes where a new session would")
		require.Equal(t, reasonLoad, ev.RoutingReason)
	}
	errs := ae.h.affm.decisions.WithLabelValues("session", "error")
	waitFor(t, "the slow lookups counted as errors", func() bool { return counterValue(errs) == slow })
	require.Zero(t, counterValue(ae.h.affm.decisions.WithLabelValues("session", "miss")), "an unread pin is not a missing one")
	require.Equal(t, pinned, ae.pin(session), "the pin is kept")

	relay.setDelay(0)
	waitFor(t, "the session back on its pin", func() bool {
		ev := ae.call(chatBody("g", ""), "x-session-id", session)
		return ev.DeploymentId == pinned && ev.RoutingReason == reasonSession
	})
	require.Equal(t, pinned, ae.pin(session))
}

// A new session whose lookup timed out is not pinned either (its pin
// could exist: another proxy may have just written it); its next turn
// with Redis answering pins it.
func TestSlowLookupNewSessionPinnedLater(t *testing.T) {
	relay := startSlowRelay(t)
	ae := newAffinityEnvVia(t, relay.addr(), slowCallTimeout, nil)
	relay.setDelay(3 * slowCallTimeout)
	ev := ae.call(chatBody("g", ""), "x-session-id", "new-slow")
	placed, _ := placement("new-slow")
	require.Equal(t, placed, ev.DeploymentId)
	waitFor(t, "the slow lookup counted", func() bool {
		return counterValue(ae.h.affm.decisions.WithLabelValues("session", "error")) == 1
	})
	require.Empty(t, ae.pin("new-slow"))
	relay.setDelay(0)
	waitFor(t, "the session pinned", func() bool {
		ae.call(chatBody("g", ""), "x-session-id", "new-slow")
		return ae.pin("new-slow") == placed
	})
}

// least_outstanding with the load lookup timing out orders by this
// proxy's own in-flight counts, ties in weighted-shuffle order: requests
// spread over the deployments instead of following the fleet-wide counts
// it could not read, or any fixed order. Each failed lookup is counted.
func TestSlowLoadLookupSpreads(t *testing.T) {
	relay := startSlowRelay(t)
	relay.setDelay(20 * affinity.DefaultCallTimeout) // every lookup times out, however loaded the machine
	ae := newAffinityEnvVia(t, relay.addr(), 0, func(d *configv1.Deployment) { d.MaxConcurrency = 16 })
	ae.setRouting(&configv1.ModelGroupRouting{Strategy: strategyLeastOutstanding})
	// Two requests of other proxies on d1: with Redis answering every
	// request would go to d2 (TestStrategyLeastOutstanding).
	held := ae.hold("d1", 2, 16)
	const n = 24
	by := map[string]int{}
	for range n {
		ev := ae.call(chatBody("g", ""))
		require.Equal(t, reasonLoad, ev.RoutingReason)
		by[ev.DeploymentId]++
	}
	t.Logf("with the load lookup timing out: %v", by)
	// Each deployment is first with probability 1/2: fewer than 3 of 24
	// on either has a probability below 1e-4.
	for _, id := range []string{"d1", "d2"} {
		require.GreaterOrEqual(t, by[id], 3, "requests per deployment: %v", by)
	}
	require.Equal(t, float64(n), counterValue(ae.h.em.loadLookups.WithLabelValues("error")))
	relay.setDelay(0)
	ae.release(held)
	ae.drained()
}

// A lookup answered in part (it timed out after some replies) counts as
// not answered for every candidate: the loads it did read are not mixed
// with this proxy's own counts for the rest, under which the unread
// candidate would look idle and draw every request.
func TestPartialLoadsNotMixed(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) { d.MaxConcurrency = 16 })
	cat := ae.cat.Load()
	var cands []candidate
	for _, d := range cat.Deployments("g") {
		cands = append(cands, candidate{d: d, st: ae.h.states.Get(d.GetId())})
	}
	require.Len(t, cands, 2)
	require.True(t, cands[0].st.Slots.TryAcquire(16)) // one request of this proxy's on the first
	defer cands[0].st.Slots.Release()
	x := &exchange{h: ae.h}
	loads := func(look affinityLookup) []int64 {
		var out []int64
		for _, l := range x.loadedOf(cands, look) {
			out = append(out, l.Load)
		}
		return out
	}
	require.Equal(t, []int64{5, 3}, loads(affinityLookup{res: affinity.Lookup{Loads: []int64{5, 3}}}), "fleet-wide counts")
	timedOut := fmt.Errorf("no reply: %w", context.DeadlineExceeded)
	require.Equal(t, []int64{1, 0}, loads(affinityLookup{res: affinity.Lookup{Loads: []int64{5, -1}}, err: timedOut}), "partial: own counts for all")
	require.Equal(t, []int64{1, 0}, loads(affinityLookup{res: affinity.Lookup{Loads: []int64{-1, -1}}, err: errors.Join(timedOut, timedOut)}))
	require.Equal(t, []int64{1, 0}, loads(affinityLookup{}), "no lookup")
}
