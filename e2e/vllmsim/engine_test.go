package vllmsim

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"
)

// The driver releases each step's tokens when the wall clock reaches the
// step's simulated end divided by the time scale; an arrival during a step
// joins at the next step boundary; and while a step runs, the engine's
// state is the one of the forward pass (the batch running, nothing sampled).
// synctest's fake clock makes the wall-clock times exact.
func TestEngineFollowsSimulatedTimeOnTheWallClock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const scale = 2
		e, err := newEngine(testEngine(nil), scale, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- e.run(ctx) }()
		start := time.Now()
		wall := func() time.Duration { return time.Since(start) }

		a := newJob(true, []int{10})
		if err := e.submit(a, []SequenceSpec{{ID: "a", Prompt: ids(1, 10), MaxTokens: 3}}); err != nil {
			t.Fatal(err)
		}
		// Step 1, simulated 0–20 ms (10 ms + 10 prefill tokens): wall 0–10 ms.
		time.Sleep(5 * time.Millisecond)
		synctest.Wait()
		if st, _ := e.stats(); st.NumRunning != 1 || st.GenerationTokens != 0 || st.NumUnfinished != 1 {
			t.Errorf("mid-step: running %d, generated %d, unfinished %d; want 1, 0, 1",
				st.NumRunning, st.GenerationTokens, st.NumUnfinished)
		}
		// b arrives mid-step, at simulated 10 ms.
		b := newJob(false, []int{10})
		if err := e.submit(b, []SequenceSpec{{ID: "b", Prompt: ids(100, 10), MaxTokens: 1}}); err != nil {
			t.Fatal(err)
		}

		<-a.notify
		if got := wall(); got != 10*time.Millisecond {
			t.Errorf("a's first token at wall %v, want 10ms", got)
		}
		events, _, _ := a.take(nil)
		if len(events) != 1 {
			t.Fatalf("%d events after step 1", len(events))
		}
		// Step 2, simulated 20–40 ms: a decodes, b prefills (10 + 10 ms).
		<-b.notify
		if got := wall(); got != 20*time.Millisecond {
			t.Errorf("b finished at wall %v, want 20ms", got)
		}
		bq := b.choices[0].seq
		if qt, _ := bq.QueueTime(); qt != 10*time.Millisecond {
			t.Errorf("b queued %v, want 10ms (arrival mid-step, admitted at the next boundary)", qt)
		}
		// Step 3, simulated 40–50 ms: a's last token.
		for {
			<-a.notify
			if done, _ := a.state(); done {
				break
			}
		}
		if got := wall(); got != 25*time.Millisecond {
			t.Errorf("a finished at wall %v, want 25ms", got)
		}
		if st, steps := e.stats(); st.Now != 50*time.Millisecond || steps != 3 {
			t.Errorf("simulated now %v after %d steps, want 50ms after 3", st.Now, steps)
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
}

// Stopping the engine fails the requests in it; a stopped engine refuses
// new ones.
func TestEngineStopFailsRequests(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, err := newEngine(testEngine(nil), 1, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- e.run(ctx) }()
		j := newJob(false, []int{10})
		if err := e.submit(j, []SequenceSpec{{ID: "a", Prompt: ids(1, 10), MaxTokens: 100}}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
		cancel()
		t.Logf("engine stopped: %v", <-done)
		if _, err := j.state(); !errors.Is(err, errEngineStopped) {
			t.Errorf("job error %v, want errEngineStopped", err)
		}
		if err := e.submit(newJob(false, []int{1}), []SequenceSpec{{ID: "b", Prompt: ids(1, 1), MaxTokens: 1}}); !errors.Is(err, errEngineStopped) {
			t.Errorf("submit after stop: %v", err)
		}
		if st, _ := e.stats(); st.NumUnfinished != 0 || st.KVCacheUsage != 0 {
			t.Errorf("after stop: %d unfinished, KV usage %v", st.NumUnfinished, st.KVCacheUsage)
		}
		// The engine can run again.
		ctx, cancel = context.WithCancel(context.Background())
		go func() { done <- e.run(ctx) }()
		synctest.Wait()
		j = newJob(false, []int{10})
		if err := e.submit(j, []SequenceSpec{{ID: "c", Prompt: ids(1, 10), MaxTokens: 2}}); err != nil {
			t.Fatal(err)
		}
		<-j.notify
		if ok, err := j.state(); !ok || err != nil {
			t.Errorf("after restart: done %v, error %v", ok, err)
		}
		cancel()
		t.Logf("engine stopped: %v", <-done)
	})
}
