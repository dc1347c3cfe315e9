package admission

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/classify"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// The class-aware admission queue (docs/traffic.md, "Admission queue").
//
// A request whose candidate deployments are all at their class caps waits
// in its proxy's queue of the model group instead of an immediate 503:
// strict priority between classes (interactive, then agent, then batch);
// within a class, fair between teams by token cost (virtual token
// counters, vtc.go): the head is the waiter of the backlogged team with
// the least served cost, first come first served within a team. Only the
// head of the highest class with waiters tries for a slot; it tries when a
// slot is released (this proxy's release applied in the limits store, or
// another proxy's release notification) and at least every retry interval,
// so a slot freed elsewhere in the fleet is seen within one retry interval
// even when a notification is lost.
//
// Each class has a bounded length and a timeout; a full queue or a timeout
// is a shed request (503 overloaded) with a retry-after from the queue's
// observed drain rate.

// Classes, in priority order (index = rank).
var Classes = [3]configv1.TrafficClass{
	configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE,
	configv1.TrafficClass_TRAFFIC_CLASS_AGENT,
	configv1.TrafficClass_TRAFFIC_CLASS_BATCH,
}

func rank(c configv1.TrafficClass) int {
	switch c {
	case configv1.TrafficClass_TRAFFIC_CLASS_AGENT:
		return 1
	case configv1.TrafficClass_TRAFFIC_CLASS_BATCH:
		return 2
	}
	return 0
}

// Bound is one class's queue bound: at most MaxLength waiting (0: no
// queue, an immediate 503), each at most Timeout.
type Bound struct {
	MaxLength int64
	Timeout   time.Duration
}

// Bounds are the per-class bounds, by rank.
type Bounds [3]Bound

// DefaultBounds are the proxy's defaults.
var DefaultBounds = Bounds{
	{MaxLength: 256, Timeout: 30 * time.Second},
	{MaxLength: 1024, Timeout: 60 * time.Second},
	{MaxLength: 1024, Timeout: 120 * time.Second},
}

// Caps on overrides (the admin API's).
const (
	maxLength  = 100_000
	maxTimeout = 600 * time.Second
)

// ParseBounds parses "interactive=256/30s,agent=1024/60s,batch=1024/2m";
// classes not named keep DefaultBounds.
func ParseBounds(s string) (Bounds, error) {
	b := DefaultBounds
	if strings.TrimSpace(s) == "" {
		return b, nil
	}
	for _, part := range strings.Split(s, ",") {
		name, val, ok := strings.Cut(strings.TrimSpace(part), "=")
		ls, ts, ok2 := strings.Cut(val, "/")
		if !ok || !ok2 {
			return b, fmt.Errorf("admission queue %q: want class=length/timeout", part)
		}
		r := -1
		for i, c := range Classes {
			if classify.Name(c) == name {
				r = i
			}
		}
		if r < 0 {
			return b, fmt.Errorf("admission queue %q: unknown class %q (interactive, agent, batch)", part, name)
		}
		n, err := strconv.ParseInt(ls, 10, 64)
		if err != nil || n < 0 || n > maxLength {
			return b, fmt.Errorf("admission queue %q: length must be 0..%d", part, maxLength)
		}
		d, err := time.ParseDuration(ts)
		if err != nil || d <= 0 || d > maxTimeout {
			return b, fmt.Errorf("admission queue %q: timeout must be a duration in (0, %s]", part, maxTimeout)
		}
		b[r] = Bound{MaxLength: n, Timeout: d}
	}
	return b, nil
}

// Resolve is class c's bound for a request of model group g whose
// candidates are deps: a deployment's override of the class wins over its
// group's (the largest among candidates that set one), the group's over
// the proxy's default; a 0 field of an override keeps the level below.
func (b Bounds) Resolve(c configv1.TrafficClass, g *configv1.ModelGroup, deps []*configv1.DeploymentTraffic) Bound {
	out := b[rank(c)]
	apply := func(qs []*configv1.ClassQueue) {
		for _, q := range qs {
			if q.GetTrafficClass() != c {
				continue
			}
			if q.GetMaxLength() > 0 {
				out.MaxLength = q.GetMaxLength()
			}
			if q.GetTimeoutMs() > 0 {
				out.Timeout = time.Duration(q.GetTimeoutMs()) * time.Millisecond
			}
		}
	}
	apply(g.GetTraffic().GetQueues())
	var best *Bound
	for _, t := range deps {
		for _, q := range t.GetQueues() {
			if q.GetTrafficClass() != c {
				continue
			}
			cand := out
			if q.GetMaxLength() > 0 {
				cand.MaxLength = q.GetMaxLength()
			}
			if q.GetTimeoutMs() > 0 {
				cand.Timeout = time.Duration(q.GetTimeoutMs()) * time.Millisecond
			}
			if best == nil {
				best = &cand
			} else {
				best.MaxLength, best.Timeout = max(best.MaxLength, cand.MaxLength), max(best.Timeout, cand.Timeout)
			}
		}
	}
	if best != nil {
		out = *best
	}
	return out
}

// Shed reasons.
const (
	ShedFull    = "queue_full"
	ShedTimeout = "timeout"
)

// Releases carries release notifications between the proxies of a
// fleet: a slot freed on one proxy wakes the waiters of every other.
type Releases interface {
	// Publish announces that this proxy released a deployment slot of
	// group (the release applied in the limits store).
	Publish(group string)
	// Watch calls wake for every release of group any proxy announces,
	// until stop is called.
	Watch(group string, wake func()) (stop func())
}

// watchLinger is how long a group's release subscription outlives its
// last waiter: a queue at the edge of saturation does not subscribe and
// unsubscribe at every request.
const watchLinger = 30 * time.Second

// Queues are a proxy's admission queues, one per model group.
type Queues struct {
	retry time.Duration
	m     *QueueMetrics
	rel   Releases

	mu     sync.Mutex
	seq    uint64 // arrival order of waiters
	groups map[string]*groupQueue
	// stats per class (rank): admitted in flight, waiting, shed.
	inFlight, queued [3]int64
	rejected         [3]uint64
}

// NewQueues returns the proxy's queues; retry is the bounded retry
// interval of a waiting head (it bounds the added wait for a slot freed by
// another proxy when its notification is lost); rel carries the fleet's
// release notifications (nil: the retry interval alone).
func NewQueues(retry time.Duration, m *QueueMetrics, rel Releases) *Queues {
	return &Queues{retry: retry, m: m, rel: rel, groups: map[string]*groupQueue{}}
}

// Released is a deployment slot of group this proxy released (applied in
// the limits store): this proxy's waiters try again, and every other
// proxy's through the fleet's notification.
func (q *Queues) Released(group string) {
	q.Notify(group)
	if q.rel != nil {
		q.rel.Publish(group)
	}
}

// watch subscribes group's queue to the fleet's releases while it has
// waiters (and watchLinger after the last); q.mu is held.
func (q *Queues) watch(name string, g *groupQueue) {
	if q.rel == nil || g.unwatch != nil {
		return
	}
	g.unwatch = q.rel.Watch(name, func() { q.Notify(name) })
}

// idle is called when group's last waiter left; q.mu is held.
func (q *Queues) idle(name string, g *groupQueue) {
	if g.unwatch == nil || g.linger != nil {
		return
	}
	g.linger = time.AfterFunc(watchLinger, func() {
		q.mu.Lock()
		g.linger = nil
		var stop func()
		if g.empty() {
			stop, g.unwatch = g.unwatch, nil
		}
		q.mu.Unlock()
		if stop != nil {
			stop()
		}
	})
}

func (g *groupQueue) empty() bool {
	return len(g.waiting[0])+len(g.waiting[1])+len(g.waiting[2]) == 0
}

type waiter struct {
	r    int
	team string
	seq  uint64
}

type groupQueue struct {
	waiting [3][]*waiter
	// vtc are the classes' virtual token counters (vtc.go).
	vtc  [3]vtc
	wake chan struct{}
	// lastOut and interval estimate the drain rate: the time between
	// requests leaving the queue admitted (EWMA).
	lastOut  time.Time
	interval time.Duration
	// unwatch ends the group's release subscription (nil: none); linger
	// is the timer that ends it once the queue stayed empty.
	unwatch func()
	linger  *time.Timer
}

func (q *Queues) group(name string) *groupQueue {
	g := q.groups[name]
	if g == nil {
		g = &groupQueue{wake: make(chan struct{})}
		q.groups[name] = g
	}
	return g
}

// head is the waiter of class rank r that may try for a slot: the first
// waiter of the backlogged team with the least served cost.
func (g *groupQueue) head(r int) *waiter {
	return g.vtc[r].head(g.waiting[r])
}

// Ahead reports whether requests of class c or higher wait for group: a
// new request of class c then queues behind them instead of trying first.
func (q *Queues) Ahead(group string, c configv1.TrafficClass) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	g := q.groups[group]
	if g == nil {
		return false
	}
	for r := 0; r <= rank(c); r++ {
		if len(g.waiting[r]) > 0 {
			return true
		}
	}
	return false
}

// Notify wakes the waiters of group (a slot of one of its deployments was
// released).
func (q *Queues) Notify(group string) {
	q.mu.Lock()
	// Only waiters wait on wake (they read it under q.mu while listed in
	// waiting): with none, every release of the group (once per request)
	// would replace the channel for nobody.
	if g := q.groups[group]; g != nil && !g.empty() {
		close(g.wake)
		g.wake = make(chan struct{})
	}
	q.mu.Unlock()
}

// Shed is a request the queue refused: why and the retry-after to answer.
type Shed struct {
	Reason     string
	RetryAfter time.Duration
}

// Wait queues a request of class c from team for group until try
// succeeds (it is called only when the request is the head of the highest
// class with waiters; it reports whether the request got a slot, or stop
// to end the wait with the caller's own answer), its bound's timeout
// passes (Shed timeout), or ctx ends (ctx's error). hint is the
// retry-after to answer while the queue has no drain rate yet. try should
// Charge the request's cost when it takes the slot.
func (q *Queues) Wait(ctx context.Context, group string, c configv1.TrafficClass, team string, b Bound, hint time.Duration, try func() (ok, stop bool)) (*Shed, error) {
	r := rank(c)
	start := time.Now()
	q.mu.Lock()
	g := q.group(group)
	if int64(len(g.waiting[r])) >= b.MaxLength {
		ra := g.retryAfter(g.above(r)+len(g.waiting[r])+1, b, hint)
		q.rejected[r]++
		q.mu.Unlock()
		q.m.Rejected.WithLabelValues(classify.Name(c), ShedFull).Inc()
		return &Shed{Reason: ShedFull, RetryAfter: ra}, nil
	}
	q.seq++
	w := &waiter{r: r, team: team, seq: q.seq}
	g.vtc[r].arrive(g.waiting[r], team)
	g.waiting[r] = append(g.waiting[r], w)
	q.queued[r]++
	q.watch(group, g)
	q.mu.Unlock()
	q.m.Depth.WithLabelValues(classify.Name(c)).Inc()
	defer q.m.Depth.WithLabelValues(classify.Name(c)).Dec()
	// leave removes w from the queue; locked, if set, runs first under the
	// same lock (a shed's retry-after sees w's place before it is gone,
	// and no waiter leaving at the same moment in between).
	leave := func(admitted bool, locked func()) {
		q.mu.Lock()
		if locked != nil {
			locked()
		}
		s := g.waiting[r]
		for i, x := range s {
			if x == w {
				g.waiting[r] = append(s[:i:i], s[i+1:]...)
				break
			}
		}
		q.queued[r]--
		g.vtc[r].changed()
		if g.empty() {
			q.idle(group, g)
		}
		if admitted {
			g.vtc[r].served(team)
			now := time.Now()
			if !g.lastOut.IsZero() {
				d := now.Sub(g.lastOut)
				if g.interval == 0 {
					g.interval = d
				} else {
					g.interval = (g.interval*7 + d) / 8
				}
			}
			g.lastOut = now
		}
		// The next head may try now.
		close(g.wake)
		g.wake = make(chan struct{})
		q.mu.Unlock()
		q.m.Wait.WithLabelValues(classify.Name(c)).Observe(time.Since(start).Seconds())
	}
	deadline := time.NewTimer(b.Timeout)
	defer deadline.Stop()
	tick := time.NewTicker(q.retry)
	defer tick.Stop()
	for {
		q.mu.Lock()
		head := g.head(r) == w
		for hr := 0; hr < r && head; hr++ {
			head = len(g.waiting[hr]) == 0
		}
		wake := g.wake
		q.mu.Unlock()
		if head {
			ok, stop := try()
			if ok || stop {
				leave(ok, nil)
				if ok {
					q.m.Admitted.WithLabelValues(classify.Name(c), "queued").Inc()
				}
				return nil, nil
			}
		}
		select {
		case <-wake:
		case <-tick.C:
		case <-deadline.C:
			var ra time.Duration
			leave(false, func() {
				ra = g.retryAfter(g.position(w), b, hint)
				q.rejected[r]++
			})
			q.m.Rejected.WithLabelValues(classify.Name(c), ShedTimeout).Inc()
			return &Shed{Reason: ShedTimeout, RetryAfter: ra}, nil
		case <-ctx.Done():
			leave(false, nil)
			return nil, ctx.Err()
		}
	}
}

// above is the number of waiters of classes higher than rank r: strict
// priority serves them first.
func (g *groupQueue) above(r int) int {
	n := 0
	for hr := 0; hr < r; hr++ {
		n += len(g.waiting[hr])
	}
	return n
}

// position is w's 1-based place in line: the waiters of higher classes,
// then those of its class that arrived before it (first come, first served
// within a team; across teams the fair order may differ, so it is an
// estimate).
func (g *groupQueue) position(w *waiter) int {
	pos := g.above(w.r) + 1
	for _, x := range g.waiting[w.r] {
		if x == w {
			break
		}
		pos++
	}
	return pos
}

// retryAfter estimates when a request at position pos (1-based) would
// leave: the queue admits one request every observed interval (EWMA of
// the time between admissions), the next one interval after the last, so
// pos × interval after the last admission, less the time since (at most
// one interval: a queue that admitted nothing for longer is overdue, not
// faster); else hint. At least 100 ms, at most the class's timeout.
func (g *groupQueue) retryAfter(pos int, b Bound, hint time.Duration) time.Duration {
	ra := hint
	if g.interval > 0 {
		ra = time.Duration(pos)*g.interval - min(time.Since(g.lastOut), g.interval)
	}
	return min(max(ra, 100*time.Millisecond), b.Timeout)
}

// Started and Ended count a request of class c admitted to a deployment
// on this proxy (the backlog's in flight).
func (q *Queues) Started(c configv1.TrafficClass) {
	q.mu.Lock()
	q.inFlight[rank(c)]++
	q.mu.Unlock()
}

// Ended uncounts what Started counted.
func (q *Queues) Ended(c configv1.TrafficClass) {
	q.mu.Lock()
	q.inFlight[rank(c)]--
	q.mu.Unlock()
}

// Backlog is GET /health/backlog: per class, this proxy's requests in
// flight at deployments, waiting, and shed since start. No tenant names.
type Backlog struct {
	Classes map[string]ClassBacklog `json:"classes"`
}

// ClassBacklog is one class's line of Backlog.
type ClassBacklog struct {
	InFlight int64  `json:"in_flight"`
	Queued   int64  `json:"queued"`
	Rejected uint64 `json:"rejected"`
}

// Backlog returns the current backlog.
func (q *Queues) Backlog() Backlog {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := Backlog{Classes: map[string]ClassBacklog{}}
	for r, c := range Classes {
		out.Classes[classify.Name(c)] = ClassBacklog{InFlight: q.inFlight[r], Queued: q.queued[r], Rejected: q.rejected[r]}
	}
	return out
}

// QueueMetrics are the sluice_admission_* series.
type QueueMetrics struct {
	Depth    *prometheus.GaugeVec
	Wait     *prometheus.HistogramVec
	Admitted *prometheus.CounterVec
	Rejected *prometheus.CounterVec
}

// NewQueueMetrics registers the sluice_admission_* series on reg.
func NewQueueMetrics(reg prometheus.Registerer) (*QueueMetrics, error) {
	m := &QueueMetrics{
		Depth: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "sluice_admission_queue_depth",
			Help: "Requests waiting in this proxy's admission queues, by class."}, []string{"class"}),
		Wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "sluice_admission_wait_seconds",
			Help:    "Time requests spent in the admission queue (admitted, shed or cancelled), by class.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120}}, []string{"class"}),
		Admitted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "sluice_admission_admitted_total",
			Help: "Requests admitted to a deployment slot after waiting in the admission queue, by class (how: queued)."}, []string{"class", "how"}),
		Rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "sluice_admission_rejected_total",
			Help: "Requests shed by the admission queue (503 overloaded), by class and reason (queue_full, timeout)."}, []string{"class", "reason"}),
	}
	for _, c := range []prometheus.Collector{m.Depth, m.Wait, m.Admitted, m.Rejected} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
