package vllmsim

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// errEngineStopped fails the requests still in the engine when it stops.
var errEngineStopped = errors.New("engine stopped")

// clock maps wall-clock time to simulated time: simulated = (wall - start) *
// scale. It uses the monotonic clock.
type clock struct {
	start time.Time
	scale float64
}

func (c clock) now() time.Duration {
	return time.Duration(float64(time.Since(c.start)) * c.scale)
}

// wallUntil is the wall-clock time left until simulated time t.
func (c clock) wallUntil(t time.Duration) time.Duration {
	return time.Duration(float64(t)/c.scale) - time.Since(c.start)
}

// engine drives a Scheduler in (scaled) real time. Handlers add sequences
// and abort them directly under mu, stamped with the current simulated time;
// one driver goroutine (run) begins a step, waits until the wall clock
// reaches the step's end, then ends it and delivers its tokens. Between the
// two the scheduler is in the state vLLM has during a forward pass, which
// is what /metrics and the admission valves see. When the driver falls behind (a large
// time scale, a busy machine), due steps run back to back with no sleep and
// the simulated timeline stays exact: the wall clock only decides when
// results are released, never what they are.
type engine struct {
	clock clock
	log   *slog.Logger
	wake  chan struct{} // wakes an idle driver; capacity 1

	mu      sync.Mutex // guards everything below; taken before job.mu
	sched   *Scheduler
	active  map[*job]struct{}
	running bool
	stopped bool
	steps   uint64
}

func newEngine(cfg EngineConfig, scale float64, log *slog.Logger) (*engine, error) {
	s, err := NewScheduler(cfg)
	if err != nil {
		return nil, err
	}
	return &engine{
		clock:  clock{start: time.Now(), scale: scale},
		log:    log,
		wake:   make(chan struct{}, 1),
		sched:  s,
		active: make(map[*job]struct{}),
	}, nil
}

// run drives the scheduler until ctx is done; then it fails the requests in
// flight. Only one run may be active at a time.
func (e *engine) run(ctx context.Context) error {
	e.mu.Lock()
	if e.running {
		e.mu.Unlock()
		return errors.New("engine is already running")
	}
	e.running, e.stopped = true, false
	e.mu.Unlock()
	defer e.stop()

	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()

	var (
		stepEnd  time.Duration
		inFlight bool
	)
	for {
		if inFlight {
			if wait := e.clock.wallUntil(stepEnd); wait > 0 {
				timer.Reset(wait)
				select {
				case <-ctx.Done():
					return nil
				case <-timer.C:
				}
				continue
			}
		}
		e.mu.Lock()
		if inFlight {
			e.deliver(e.sched.EndStep())
			inFlight = false
		}
		if e.sched.Idle() {
			e.mu.Unlock()
			select {
			case <-ctx.Done():
				return nil
			case <-e.wake:
			}
			continue
		}
		res := e.sched.BeginStep()
		e.steps++
		stepEnd = res.Start + res.Duration
		inFlight = true
		e.mu.Unlock()
		if ctx.Err() != nil {
			return nil
		}
	}
}

// stop fails every request still in the engine.
func (e *engine) stop() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.running, e.stopped = false, true
	if len(e.active) > 0 {
		e.log.Debug("engine stopped with requests in flight", slog.Int("requests", len(e.active)))
	}
	for j := range e.active {
		for _, c := range j.choices {
			if c.seq != nil {
				e.sched.Abort(c.seq)
				c.seq.owner = nil
			}
		}
		j.fail(errEngineStopped)
	}
	clear(e.active)
	e.sched.EndStep() // a step left in flight only holds aborted sequences now
}

// submit admits a request's sequences, all arriving now, or returns the
// admission error (ErrQueueOverflow, ErrQueuedTokens, errEngineStopped).
func (e *engine) submit(j *job, specs []SequenceSpec) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stopped {
		return errEngineStopped
	}
	if err := e.sched.CheckAdmission(len(specs)); err != nil {
		return err
	}
	now := e.clock.now()
	for i := range specs {
		specs[i].Arrival = now
		q, err := e.sched.Add(specs[i])
		if err != nil {
			for _, c := range j.choices[:i] {
				e.sched.Abort(c.seq)
				c.seq.owner = nil
			}
			return err
		}
		q.owner = j.choices[i]
		j.choices[i].seq = q
	}
	e.active[j] = struct{}{}
	select {
	case e.wake <- struct{}{}:
	default:
	}
	return nil
}

// abort removes a request's unfinished sequences (its client went away).
func (e *engine) abort(j *job) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.active[j]; !ok {
		return
	}
	for _, c := range j.choices {
		if c.seq != nil {
			e.sched.Abort(c.seq)
			c.seq.owner = nil
		}
	}
	delete(e.active, j)
}

// deliver hands a step's tokens and finishes to the jobs waiting for them.
// Streaming jobs are woken for every step that gives them something;
// non-streaming ones only when they are complete.
func (e *engine) deliver(res *StepResult) {
	for _, ev := range res.Tokens {
		c := ev.Seq.owner
		if c == nil {
			continue
		}
		j := c.job
		j.mu.Lock()
		c.numTokens++
		if j.stream {
			// A sequence samples at most one token a step, so one that
			// finished in this step finished on this token: its finish
			// reason goes on the token's event, in the same critical
			// section, so the handler can never take the token without it
			// (as in vLLM, the last delta carries finish_reason).
			je := jobEvent{choice: c.index, text: ev.Text}
			if ev.Seq.status == StatusFinished {
				je.finish = ev.Seq.reason
				c.finishQueued = true
			}
			j.events = append(j.events, je)
		} else {
			c.text.WriteString(ev.Text)
		}
		j.mu.Unlock()
		if j.stream {
			j.signal()
		}
	}
	for _, ev := range res.Finished {
		c := ev.Seq.owner
		if c == nil {
			continue
		}
		ev.Seq.owner = nil
		j := c.job
		j.mu.Lock()
		c.reason = ev.Reason
		c.cachedTokens = ev.Seq.NumCachedTokens()
		j.remaining--
		done := j.remaining == 0
		if j.stream && !c.finishQueued {
			// Finished without sampling (a prefill-only sequence): a finish-only event.
			j.events = append(j.events, jobEvent{choice: c.index, finish: ev.Reason, noText: true})
			c.finishQueued = true
		}
		j.mu.Unlock()
		if done {
			delete(e.active, j)
		}
		if j.stream || done {
			j.signal()
		}
	}
}

// stats returns the scheduler's metrics and the number of steps run.
func (e *engine) stats() (Stats, uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.sched.Stats(), e.steps
}

// job is one API request: one or more sequences (choices) whose events a
// handler consumes.
type job struct {
	stream  bool
	choices []*choice
	notify  chan struct{} // capacity 1

	mu        sync.Mutex // guards the fields below and the choices' results
	events    []jobEvent // streaming: undelivered events, in order
	remaining int
	err       error
}

// choice is one sequence of a job, from the handler's point of view.
type choice struct {
	job          *job
	index        int
	seq          *Sequence // set by submit; read only under engine.mu
	promptTokens int
	text         strings.Builder // non-streaming output
	numTokens    int
	reason       FinishReason
	cachedTokens int
	finishQueued bool // streaming: the finish reason is in an event
}

// jobEvent is one output token of a choice, or the finish of a choice whose
// last step produced no text event.
type jobEvent struct {
	choice int
	text   string
	noText bool
	finish FinishReason
}

func newJob(stream bool, promptTokens []int) *job {
	j := &job{stream: stream, notify: make(chan struct{}, 1), remaining: len(promptTokens)}
	j.choices = make([]*choice, len(promptTokens))
	for i, n := range promptTokens {
		j.choices[i] = &choice{job: j, index: i, promptTokens: n}
	}
	return j
}

func (j *job) signal() {
	select {
	case j.notify <- struct{}{}:
	default:
	}
}

func (j *job) fail(err error) {
	j.mu.Lock()
	if j.err == nil {
		j.err = err
	}
	j.mu.Unlock()
	j.signal()
}

// state reports whether the job is complete and its error.
func (j *job) state() (bool, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.remaining == 0, j.err
}

// take swaps out the pending events into buf (which it returns, reused) and
// reports whether the job is complete and its error.
func (j *job) take(buf []jobEvent) ([]jobEvent, bool, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	buf = append(buf[:0], j.events...)
	clear(j.events)
	j.events = j.events[:0]
	return buf, j.remaining == 0, j.err
}
