package limits

import (
	"context"
	"fmt"
	"sync"

	"github.com/sluicegw/sluice/internal/budget"
)

// Batched admissions (issue 15; docs/limits.md, "One round trip, all or
// nothing"). Admissions of one org that arrive while a call of admit.lua
// for that org is in flight wait for it and then go together, in one call:
// the script admits them in order, each against the state the previous
// left, so a batch decides exactly what the same admissions one by one
// would have; it reads and writes each scope they share once. An admission
// finding no call of its org in flight goes at once: an idle org pays no
// latency for it.

// maxAdmitBatch bounds the admissions of one call.
const maxAdmitBatch = 32

// admitJob is one admission waiting for (or in) a call.
type admitJob struct {
	req   *Request
	units []budget.Unit
	lease *Lease
	// Set by the call that ran the job (before done is closed).
	vals []int64
	err  error
	done chan struct{}
	// state is guarded by the batcher's mutex.
	state jobState
}

type jobState int

const (
	jobQueued jobState = iota
	jobRunning
	jobAbandoned // its caller returned (deadline) while it was queued
)

// admitBatcher holds, per org, whether a call is in flight and the
// admissions waiting for it.
type admitBatcher struct {
	mu   sync.Mutex
	orgs map[string]*orgAdmits
}

type orgAdmits struct {
	q []*admitJob
}

// do runs j in a call of its org's admissions and returns its part of the
// result. A job waits at most the call timeout in all (queued and in its
// call); a job whose deadline passed while it was still queued is dropped
// and never runs.
func (b *admitBatcher) do(ctx context.Context, l *Limiter, j *admitJob) ([]int64, error) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout)
	defer cancel()
	if l.cfg.admitUnbatched {
		l.callAdmits(ctx, []*admitJob{j})
		return j.vals, j.err
	}
	org := j.req.OrgID
	b.mu.Lock()
	if b.orgs == nil {
		b.orgs = map[string]*orgAdmits{}
	}
	o, busy := b.orgs[org]
	if !busy {
		// No call in flight: this one goes now.
		b.orgs[org] = &orgAdmits{}
		j.state = jobRunning
		b.mu.Unlock()
		l.runAdmits(ctx, org, []*admitJob{j})
		return j.vals, j.err
	}
	j.done = make(chan struct{})
	o.q = append(o.q, j)
	b.mu.Unlock()
	select {
	case <-j.done:
		return j.vals, j.err
	case <-ctx.Done():
	}
	b.mu.Lock()
	if j.state == jobQueued {
		j.state = jobAbandoned
	}
	b.mu.Unlock()
	select {
	case <-j.done: // finished meanwhile
		return j.vals, j.err
	default:
	}
	return nil, ctx.Err()
}

// runAdmits runs one call for jobs (of org) under ctx, then hands the
// admissions that queued meanwhile to a call of their own, or marks the
// org idle.
func (l *Limiter) runAdmits(ctx context.Context, org string, jobs []*admitJob) {
	l.callAdmits(ctx, jobs)
	b := &l.admits
	b.mu.Lock()
	o := b.orgs[org]
	var next []*admitJob
	for len(o.q) > 0 && len(next) < maxAdmitBatch {
		j := o.q[0]
		o.q = o.q[1:]
		if j.state == jobQueued {
			j.state = jobRunning
			next = append(next, j)
		}
	}
	if len(next) == 0 {
		delete(b.orgs, org)
		b.mu.Unlock()
		return
	}
	b.mu.Unlock()
	// The next call runs on a goroutine of its own, so that this caller
	// returns with its answer; its deadline is the call timeout, and each
	// waiting admission still answers by its own deadline.
	go func() {
		cctx, cancel := context.WithTimeout(context.Background(), l.cfg.CallTimeout)
		defer cancel()
		l.runAdmits(cctx, org, next)
	}()
}

// callAdmits makes one admit.lua call for jobs and sets each job's result.
func (l *Limiter) callAdmits(ctx context.Context, jobs []*admitJob) {
	c := l.admitCall(jobs)
	vals, err := l.store.eval(ctx, admitScript, c)
	c.args.release()
	var parts [][]int64
	if err == nil {
		parts, err = splitAdmits(vals, len(jobs))
	}
	for i, j := range jobs {
		if err != nil {
			j.err = err
		} else {
			j.vals = parts[i]
		}
		if j.done != nil {
			close(j.done)
		}
	}
}

// splitAdmits cuts admit.lua's result into each request's values.
func splitAdmits(vals []int64, n int) ([][]int64, error) {
	out := make([][]int64, 0, n)
	for i := 0; len(out) < n; {
		if i >= len(vals) || vals[i] < 0 || i+1+int(vals[i]) > len(vals) {
			return nil, fmt.Errorf("admit returned %d values for %d requests", len(vals), n)
		}
		out = append(out, vals[i+1:i+1+int(vals[i])])
		i += 1 + int(vals[i])
		if len(out) == n && i != len(vals) {
			return nil, fmt.Errorf("admit returned %d values, read %d", len(vals), i)
		}
	}
	return out, nil
}

// admitCall builds the admit.lua call of jobs (one org): the epoch, their
// records, each distinct scope's keys once, then the org's lease index.
func (l *Limiter) admitCall(jobs []*admitJob) scriptCall {
	first := jobs[0].lease
	keys := make([]string, 0, 2+len(jobs)+keysPerScope*len(first.scopes))
	keys = append(keys, first.keys[0])
	for _, j := range jobs {
		keys = append(keys, j.lease.keys[1])
	}
	args := newArgv()
	args.int(ms(l.cfg.LeaseTTL))
	args.int(ms(l.cfg.Quarantine))
	args.int(ms(l.cfg.RecordTTL))
	args.int(ms(l.cfg.ParallelRetryMax))
	args.int(ms(l.cfg.rateWindow))
	args.int(ms(l.cfg.rateBucket))
	args.int(int64(len(jobs)))
	distinct := make(map[string]int, len(first.scopes))
	for _, j := range jobs {
		req, lease := j.req, j.lease
		args.str(req.RequestID)
		args.int(req.EstTokens)
		args.int(req.MaxCostMicros)
		args.bool(lease.needs)
		args.int(int64(len(req.Scopes)))
		for i, s := range req.Scopes {
			hk := lease.keys[2+keysPerScope*i]
			d, ok := distinct[hk]
			if !ok {
				keys = append(keys, hk, lease.keys[3+keysPerScope*i])
				d = (len(keys) - 1 - len(jobs)) / keysPerScope
				distinct[hk] = d
			}
			args.int(int64(d))
			args.int(s.RPM)
			args.int(s.TPM)
			args.int(s.MaxParallel)
			if s.Budget != nil {
				args.int(s.Budget.CapMicros)
				args.str(j.units[i].Unit)
				args.int(j.units[i].N)
			} else {
				args.int(0)
				args.str("-")
				args.int(0)
			}
		}
		lease.sweep.appendNote(args)
		if p := req.Prefill; p != nil {
			args.int(int64(p.Scope + 1))
			args.int(p.Tokens)
			args.int(p.Cap)
		} else {
			args.int(0)
			args.int(0)
			args.int(0)
		}
	}
	keys = append(keys, first.keys[len(first.keys)-1]) // the org's lease index
	return scriptCall{keys: keys, args: args}
}
