package gateway

import (
	"bufio"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/forward"
	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// gatedStream streams one chunk, then waits for a value on (or the close
// of) finish before it ends cleanly ([DONE]), or is cut when cut is set.
func gatedStream(finish <-chan struct{}, cut *atomic.Bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-finish:
		case <-r.Context().Done():
			return
		}
		if cut != nil && cut.Load() {
			return
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}
}

// firstData starts a stream and reports on the returned channel when its
// first data line arrived and then its last one.
type streamRead struct {
	first chan struct{}
	last  chan string
}

func (e *env) startStream(t *testing.T, tok, group string) streamRead {
	sr := streamRead{first: make(chan struct{}), last: make(chan string, 1)}
	go func() {
		resp := e.post(RouteChat, tok, chatBody(group, `"stream":true`))
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		last, seen := "", false
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				if !seen {
					seen = true
					close(sr.first)
				}
				last = v
			}
		}
		if !seen {
			last = fmt.Sprintf("status %d", resp.StatusCode)
		}
		sr.last <- last
	}()
	return sr
}

func arrived(ch <-chan struct{}, within time.Duration) bool {
	select {
	case <-ch:
		return true
	case <-time.After(within):
		return false
	}
}

func (e *env) holds(dep, reason, outcome string) float64 {
	return counterValue(e.h.m.streamHolds.WithLabelValues(dep, reason, outcome))
}

// TestStreamProbationHoldsUntilProven: on a fresh proxy the deployment is
// on probation: its streams are held back (nothing reaches the clients
// while their engine streams); the first that ends cleanly proves it and
// releases every stream held on it at once (before their own end); the
// next stream is relayed at once.
func TestStreamProbationHoldsUntilProven(t *testing.T) {
	t.Parallel()
	finishA, finishB := make(chan struct{}), make(chan struct{})
	var n atomic.Int64
	eng := newFakeEngine(t, func(w http.ResponseWriter, r *http.Request) {
		switch n.Add(1) {
		case 1:
			gatedStream(finishA, nil)(w, r)
		case 2:
			gatedStream(finishB, nil)(w, r)
		default:
			stream(0, 0, 2, false)(w, r)
		}
	})
	e := newEnv(t, withProbation)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d", "g", eng.base(), nil)
	e.apply()

	a := e.startStream(t, tok, "g")
	waitFor(t, "stream A upstream", func() bool { return n.Load() == 1 })
	b := e.startStream(t, tok, "g")
	waitFor(t, "stream B upstream", func() bool { return n.Load() == 2 })
	require.False(t, arrived(a.first, 300*time.Millisecond), "a stream to a deployment on probation reached its client")
	require.False(t, arrived(b.first, 0), "a stream to a deployment on probation reached its client")

	start := time.Now()
	close(finishA) // A ends cleanly: the deployment is proven
	require.Equal(t, "[DONE]", <-a.last)
	require.True(t, arrived(b.first, time.Second), "the proof did not release the stream held on the deployment")
	t.Logf("B released %s after A's proof", time.Since(start).Round(time.Millisecond))
	require.Less(t, time.Since(start), forward.ProbeHoldMax, "released by the hold's bound, not the proof")
	close(finishB)
	require.Equal(t, "[DONE]", <-b.last)
	require.Equal(t, 1.0, e.holds("d", forward.HoldProbation, forward.HoldDone))
	require.Equal(t, 1.0, e.holds("d", forward.HoldProbation, forward.HoldReleased))
	require.Equal(t, 1.0, counterValue(e.h.m.probation.WithLabelValues("d", "proven")))

	// Proven: relayed at once, not held.
	c := e.startStream(t, tok, "g")
	require.Equal(t, "[DONE]", <-c.last)
	require.Equal(t, 2.0, e.holds("d", forward.HoldProbation, forward.HoldDone)+e.holds("d", forward.HoldProbation, forward.HoldReleased))
	require.True(t, e.h.states.Get("d").Health.Probation.Proven())
}

// TestStreamProbationCutRetried: a deployment on probation that cuts its
// streams after their first chunk costs no client stream: each cut lands
// inside the hold and is retried on the other deployment (2 attempts,
// [DONE]); the cuts eject it after 3. A proven deployment's cut after
// bytes puts it back on probation: its next stream is held again.
func TestStreamProbationCutRetried(t *testing.T) {
	t.Parallel()
	cutter := newFakeEngine(t, stream(0, 5*time.Millisecond, 1, true))
	good := newFakeEngine(t, stream(0, 0, 2, false))
	e := newEnv(t, withProbation, func(c *Config) { c.EjectionBase, c.EjectionMax = time.Minute, time.Minute })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("cutter", "g", cutter.base(), func(d *configv1.Deployment) { d.Weight = 1000 })
	e.deploy("good", "g", good.base(), func(d *configv1.Deployment) { d.Weight = 1 })
	e.apply()
	h := &e.h.states.Get("cutter").Health
	for h.Ejected(time.Now()) == false {
		resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
		data := sseData(t, resp.Body)
		resp.Body.Close()
		require.Equal(t, "[DONE]", data[len(data)-1], "a cut reached the client")
		if cutter.n.Load() > 10 {
			t.Fatal("the stream-cutter was not ejected")
		}
	}
	require.Equal(t, int64(3), cutter.n.Load(), "ejected after 3 cuts")
	require.Equal(t, 3.0, e.holds("cutter", forward.HoldProbation, forward.HoldCut))
	require.Equal(t, 3.0, e.attemptCount("cutter", "healthy", "retryable"))
	require.False(t, h.Probation.Proven())

	// A proven deployment cutting a stream after bytes: back on probation.
	var cut atomic.Bool
	finish := make(chan struct{}, 1)
	flaky := newFakeEngine(t, gatedStream(finish, &cut))
	e2 := newEnv(t, withProbation)
	tok2 := e2.key("k1", nil)
	e2.group("g")
	e2.deploy("f", "g", flaky.base(), nil)
	e2.apply()
	h2 := &e2.h.states.Get("f").Health
	finish <- struct{}{}
	w := e2.startStream(t, tok2, "g") // the warm-up: held, ends cleanly, proves it
	require.Equal(t, "[DONE]", <-w.last)
	require.True(t, h2.Probation.Proven())
	cut.Store(true)
	s := e2.startStream(t, tok2, "g")
	require.True(t, arrived(s.first, time.Second), "a proven deployment's stream was held")
	finish <- struct{}{}
	require.Contains(t, <-s.last, oai.CodeUpstreamStreamError, "the cut after bytes reaches the client as an error event")
	require.False(t, h2.Probation.Proven(), "a cut left the deployment proven")
	require.Equal(t, 1.0, counterValue(e2.h.m.probation.WithLabelValues("f", "revoked")))
	cut.Store(false)
	s2 := e2.startStream(t, tok2, "g")
	require.False(t, arrived(s2.first, 300*time.Millisecond), "back on probation, yet not held")
	finish <- struct{}{}
	require.Equal(t, "[DONE]", <-s2.last)
	require.True(t, h2.Probation.Proven())
}

// TestStreamProbationBounded: a stream on probation is held at most
// forward.ProbeHoldMax even while its engine stalls (the watcher releases
// it without waiting for the next event), and outliving the hold proves
// the deployment.
func TestStreamProbationBounded(t *testing.T) {
	t.Parallel()
	finish := make(chan struct{})
	eng := newFakeEngine(t, gatedStream(finish, nil))
	e := newEnv(t, withProbation)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d", "g", eng.base(), nil)
	e.apply()
	start := time.Now()
	s := e.startStream(t, tok, "g")
	require.True(t, arrived(s.first, forward.ProbeHoldMax+2*time.Second), "held past the hold's bound")
	held := time.Since(start)
	t.Logf("first event after %s (hold %s)", held.Round(time.Millisecond), forward.ProbeHoldMax)
	require.GreaterOrEqual(t, held, forward.ProbeHoldMax)
	require.Equal(t, 1.0, e.holds("d", forward.HoldProbation, forward.HoldBounds))
	require.True(t, e.h.states.Get("d").Health.Probation.Proven(), "a stream outliving the hold proves the deployment")
	close(finish)
	require.Equal(t, "[DONE]", <-s.last)
}

// TestStreamProbationOff: with the probation off (--stream-probation=
// false) a fresh deployment's streams are relayed at once and a cut after
// the first chunk reaches the client (the behaviour before probation);
// nothing is held.
func TestStreamProbationOff(t *testing.T) {
	t.Parallel()
	cutter := newFakeEngine(t, stream(0, 5*time.Millisecond, 1, true))
	e := newEnv(t, func(c *Config) { c.NoStreamProbation = true })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("cutter", "g", cutter.base(), nil)
	e.apply()
	resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
	data := sseData(t, resp.Body)
	resp.Body.Close()
	require.Contains(t, data[len(data)-1], oai.CodeUpstreamStreamError, "the cut reaches the client")
	require.Equal(t, "1", resp.Header.Get(oai.HeaderAttempts))
	for _, o := range []string{forward.HoldDone, forward.HoldReleased, forward.HoldBounds, forward.HoldCut, forward.HoldAborted} {
		require.Zero(t, e.holds("cutter", forward.HoldProbation, o))
	}
}
