package vllmsim

import (
	"bufio"
	"io"
	"maps"
	"slices"
	"strconv"
	"sync"
)

// PriorityNone is the ReceivedPriorities key of requests that carried no
// priority at all (neither the body field nor X-Vllm-Priority), which is
// not the same as an explicit 0: a gateway that must not send a priority
// to an fcfs engine is checked against this key.
const PriorityNone = "none"

// Outcomes of a received priority.
const (
	// PriorityAccepted: the request passed the priority check (it may still
	// fail later validation).
	PriorityAccepted = "accepted"
	// PriorityRejected: a non-zero priority on an fcfs engine, answered 400.
	PriorityRejected = "rejected"
)

// PriorityKey is one ReceivedPriorities entry.
type PriorityKey struct {
	// Priority is the decimal priority the request carried, or PriorityNone.
	Priority string
	// Outcome is PriorityAccepted or PriorityRejected.
	Outcome string
}

// priorityLog counts the priorities requests arrived with, so tests can
// assert what the engine saw (SPEC §7.2 engine priority). Exposed as
// vllm_sim:request_priority_total{priority,outcome} on /metrics (a
// simulator series: vLLM has no such metric) and by ReceivedPriorities.
type priorityLog struct {
	mu sync.Mutex
	n  map[PriorityKey]uint64
}

func (l *priorityLog) record(present bool, p int, rejected bool) {
	k := PriorityKey{Priority: PriorityNone, Outcome: PriorityAccepted}
	if present {
		k.Priority = strconv.Itoa(p)
	}
	if rejected {
		k.Outcome = PriorityRejected
	}
	l.mu.Lock()
	if l.n == nil {
		l.n = map[PriorityKey]uint64{}
	}
	l.n[k]++
	l.mu.Unlock()
}

func (l *priorityLog) snapshot() map[PriorityKey]uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.n)
}

// ReceivedPriorities returns how many /v1 generation and embedding
// requests arrived with each priority (PriorityNone when they carried
// none) and whether the engine accepted it. It is never nil.
func (s *Server) ReceivedPriorities() map[PriorityKey]uint64 {
	m := s.prios.snapshot()
	if m == nil {
		m = map[PriorityKey]uint64{}
	}
	return m
}

// writePriorityMetrics appends vllm_sim:request_priority_total in the
// exposition format, priorities in a stable order.
func writePriorityMetrics(w io.Writer, model string, counts map[PriorityKey]uint64) error {
	bw := bufio.NewWriter(w)
	const name = "vllm_sim:request_priority_total"
	header(bw, name, "Requests received by the priority they carried (simulator only).", "counter")
	keys := slices.SortedFunc(maps.Keys(counts), func(a, b PriorityKey) int {
		if a.Priority != b.Priority {
			if a.Priority < b.Priority {
				return -1
			}
			return 1
		}
		if a.Outcome < b.Outcome {
			return -1
		}
		if a.Outcome > b.Outcome {
			return 1
		}
		return 0
	})
	base := `engine="0",model_name="` + escapeLabel(model) + `"`
	for _, k := range keys {
		sample(bw, name, base+`,priority="`+escapeLabel(k.Priority)+`",outcome="`+k.Outcome+`"`, float64(counts[k]))
	}
	return bw.Flush()
}
