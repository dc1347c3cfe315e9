package admission

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

func newQueues(t *testing.T) *Queues {
	m, err := NewQueueMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	return NewQueues(time.Hour, m, nil) // wake-ups only by Notify
}

// TestStrictPriority: with one slot freed at a time, every waiting
// interactive request goes before any agent one, and agents before batch;
// first come first served within a class (one team).
func TestStrictPriority(t *testing.T) {
	t.Parallel()
	q := newQueues(t)
	var free atomic.Int64
	var mu sync.Mutex
	var order []string
	b := Bound{MaxLength: 10, Timeout: 10 * time.Second}
	var wg sync.WaitGroup
	start := func(c configv1.TrafficClass, name string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			shed, err := q.Wait(context.Background(), "g", c, "t", b, time.Second, func() (bool, bool) {
				for {
					n := free.Load()
					if n <= 0 {
						return false, false
					}
					if free.CompareAndSwap(n, n-1) {
						mu.Lock()
						order = append(order, name)
						mu.Unlock()
						return true, false
					}
				}
			})
			require.NoError(t, err)
			require.Nil(t, shed)
		}()
		waitQueued(t, q, c)
	}
	agent, batch, inter := Classes[1], Classes[2], Classes[0]
	start(batch, "b1")
	start(agent, "a1")
	start(inter, "i1")
	start(agent, "a2")
	start(inter, "i2")
	for want := 1; want <= 5; want++ {
		free.Add(1)
		q.Notify("g")
		require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == want }, 5*time.Second, time.Millisecond)
	}
	wg.Wait()
	require.Equal(t, []string{"i1", "i2", "a1", "a2", "b1"}, order)
}

var queuedSeen sync.Map

func waitQueued(t *testing.T, q *Queues, c configv1.TrafficClass) {
	t.Helper()
	before, _ := queuedSeen.LoadOrStore(q, map[int]int64{})
	seen := before.(map[int]int64)
	r := rank(c)
	require.Eventually(t, func() bool {
		q.mu.Lock()
		defer q.mu.Unlock()
		return q.queued[r] > seen[r]
	}, 5*time.Second, time.Millisecond)
	q.mu.Lock()
	seen[r] = q.queued[r]
	q.mu.Unlock()
}

// TestQueueBounds: a full class queue sheds at once, a waiter sheds at its
// timeout (not much later), and the retry-after follows the drain rate.
func TestQueueBounds(t *testing.T) {
	t.Parallel()
	q := newQueues(t)
	never := func() (bool, bool) { return false, false }
	b := Bound{MaxLength: 1, Timeout: 200 * time.Millisecond}
	done := make(chan *Shed, 1)
	t0 := time.Now()
	go func() {
		s, _ := q.Wait(context.Background(), "g", Classes[1], "t", b, time.Second, never)
		done <- s
	}()
	waitQueued(t, q, Classes[1])
	s, err := q.Wait(context.Background(), "g", Classes[1], "t", b, time.Second, never)
	require.NoError(t, err)
	require.Equal(t, ShedFull, s.Reason)
	s = <-done
	took := time.Since(t0)
	require.Equal(t, ShedTimeout, s.Reason)
	require.GreaterOrEqual(t, took, b.Timeout)
	require.Less(t, took, b.Timeout+150*time.Millisecond)
	require.Equal(t, 200*time.Millisecond, s.RetryAfter, "no drain observed: the hint, capped at the timeout")
	bl := q.Backlog()
	require.Equal(t, uint64(2), bl.Classes["agent"].Rejected)
	require.Zero(t, bl.Classes["agent"].Queued)

	// A class without a queue length sheds at once.
	s, err = q.Wait(context.Background(), "g", Classes[2], "t", Bound{}, time.Second, never)
	require.NoError(t, err)
	require.Equal(t, ShedFull, s.Reason)

	// A cancelled waiter leaves with ctx's error.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = q.Wait(ctx, "g", Classes[0], "t", Bound{MaxLength: 5, Timeout: time.Minute}, time.Second, never)
	require.ErrorIs(t, err, context.Canceled)
}

func TestParseBounds(t *testing.T) {
	t.Parallel()
	b, err := ParseBounds("interactive=8/2s, batch=0/1m")
	require.NoError(t, err)
	require.Equal(t, Bound{8, 2 * time.Second}, b[0])
	require.Equal(t, DefaultBounds[1], b[1])
	require.Equal(t, Bound{0, time.Minute}, b[2])
	for _, bad := range []string{"chat=1/1s", "agent=1", "agent=-1/1s", "agent=1/0s", "agent=1/11m"} {
		_, err := ParseBounds(bad)
		require.Error(t, err, bad)
	}
	g := &configv1.ModelGroup{Traffic: &configv1.ModelGroupTraffic{Queues: []*configv1.ClassQueue{{TrafficClass: Classes[1], MaxLength: 5}}}}
	d := &configv1.DeploymentTraffic{Queues: []*configv1.ClassQueue{{TrafficClass: Classes[1], TimeoutMs: 500}}}
	require.Equal(t, Bound{5, 500 * time.Millisecond}, b.Resolve(Classes[1], g, []*configv1.DeploymentTraffic{d}))
	require.Equal(t, b[0], b.Resolve(Classes[0], g, []*configv1.DeploymentTraffic{d}))
}

// TestFairShareWithinClass: two agent teams, both backlogged, one with 10×
// the waiters and 4× the cost per request; slots freed one at a time go so
// that the teams' served cost stays even (VTC), where first come first
// served would serve them in proportion to their waiters. A team that becomes backlogged late starts at
// the least counter, not at 0.
func TestFairShareWithinClass(t *testing.T) {
	t.Parallel()
	q := newQueues(t)
	agent := Classes[1]
	b := Bound{MaxLength: 1000, Timeout: time.Minute}
	var free atomic.Int64
	var mu sync.Mutex
	served := map[string]float64{}
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// loop keeps one waiter of team in the queue per worker; two workers
	// keep a team backlogged while one of them is being served (a team
	// with no waiter left is lifted when it comes back, as in VTC).
	loop := func(team string, cost float64) {
		defer wg.Done()
		for ctx.Err() == nil {
			_, err := q.Wait(ctx, "g", agent, team, b, time.Second, func() (bool, bool) {
				for {
					n := free.Load()
					if n <= 0 {
						return false, false
					}
					if free.CompareAndSwap(n, n-1) {
						q.Charge("g", agent, team, cost)
						mu.Lock()
						served[team] += cost
						mu.Unlock()
						return true, false
					}
				}
			})
			if err != nil {
				return
			}
		}
	}
	for range 20 {
		wg.Add(1)
		go loop("big", 4000)
	}
	for range 2 {
		wg.Add(1)
		go loop("small", 1000)
	}
	require.Eventually(t, func() bool { return q.Backlog().Classes["agent"].Queued == 22 }, 5*time.Second, time.Millisecond)
	// One slot at a time, each once every loop waits again (both teams
	// stay backlogged).
	step := func(n int, waiting int64) {
		for range n {
			free.Add(1)
			q.Notify("g")
			require.Eventually(t, func() bool {
				return free.Load() == 0 && q.Backlog().Classes["agent"].Queued == waiting
			}, 5*time.Second, 100*time.Microsecond)
		}
	}
	step(200, 22)
	mu.Lock()
	big, small := served["big"], served["small"]
	mu.Unlock()
	ratio := max(big, small) / min(big, small)
	jain := (big + small) * (big + small) / (2 * (big*big + small*small))
	t.Logf("served cost big %.0f small %.0f: ratio %.3f, Jain index %.4f", big, small, ratio, jain)
	require.LessOrEqual(t, ratio, 1.25)

	// A third team arriving now starts at the least backlogged counter.
	wg.Add(1)
	go loop("late", 1000)
	require.Eventually(t, func() bool { return q.Backlog().Classes["agent"].Queued == 23 }, 5*time.Second, time.Millisecond)
	least := min(q.Served("g", agent, "big"), q.Served("g", agent, "small"))
	require.InDelta(t, least, q.Served("g", agent, "late"), 0.5, "lifted to the least counter")
	step(60, 23)
	late := q.Served("g", agent, "late") - least
	require.Greater(t, late, 0.0, "the late team is served")
	require.Less(t, late, 60*1000.0, "but it does not take every slot to catch up from 0")
	cancel()
	wg.Wait()
}

// TestRetryAfterFromPosition: a shed waiter's retry-after is its own place
// in line (higher classes first, then its class's earlier arrivals) times
// the drain interval, counted from the last admission (less the time
// since, at most one interval), within [100 ms, timeout].
func TestRetryAfterFromPosition(t *testing.T) {
	t.Parallel()
	g := &groupQueue{interval: 300 * time.Millisecond, lastOut: time.Now()}
	hi, a1, a2, a3 := &waiter{r: 0}, &waiter{r: 1}, &waiter{r: 1}, &waiter{r: 1}
	g.waiting[0] = []*waiter{hi}
	g.waiting[1] = []*waiter{a1, a2, a3}
	require.Equal(t, 1, g.position(hi))
	require.Equal(t, 2, g.position(a1))
	require.Equal(t, 3, g.position(a2), "behind the interactive waiter and a1, not the class's whole queue")
	b := Bound{MaxLength: 10, Timeout: 5 * time.Second}
	ra := g.retryAfter(g.position(a2), b, time.Second)
	require.InDelta(t, float64(900*time.Millisecond), float64(ra), float64(50*time.Millisecond))
	g.lastOut = time.Now().Add(-200 * time.Millisecond) // the next admission is due in 100 ms
	ra = g.retryAfter(g.position(a2), b, time.Second)
	require.InDelta(t, float64(700*time.Millisecond), float64(ra), float64(50*time.Millisecond))
	g.lastOut = time.Now().Add(-time.Minute) // overdue: at most one interval off
	require.Equal(t, 600*time.Millisecond, g.retryAfter(g.position(a2), b, time.Second))
	require.Equal(t, 100*time.Millisecond, g.retryAfter(1, b, time.Second), "the floor")
	require.Equal(t, 500*time.Millisecond, g.retryAfter(g.position(a3), Bound{MaxLength: 10, Timeout: 500 * time.Millisecond}, time.Second), "at most the timeout")
	require.Equal(t, 2*time.Second, (&groupQueue{}).retryAfter(3, b, 2*time.Second), "no drain observed: the hint")
}
