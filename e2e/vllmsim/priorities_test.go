package vllmsim

import (
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// The simulator records the priority every request arrived with, "none"
// for requests that carried none, and whether the engine refused it.
func TestReceivedPriorities(t *testing.T) {
	fcfs := startSim(t, nil)
	fcfs.do("/v1/chat/completions", chatBody("x", map[string]any{"max_tokens": 1}), http.StatusOK, nil)
	fcfs.do("/v1/chat/completions", chatBody("x", map[string]any{"max_tokens": 1, "priority": 0}), http.StatusOK, nil)
	fcfs.do("/v1/chat/completions", chatBody("x", map[string]any{"priority": 10}), http.StatusBadRequest, nil)
	fcfs.do("/v1/completions", map[string]any{"model": fcfs.names[0], "prompt": "x", "max_tokens": 1}, http.StatusBadRequest, nil,
		"X-Vllm-Priority: -3")
	want := map[PriorityKey]uint64{
		{PriorityNone, PriorityAccepted}: 1,
		{"0", PriorityAccepted}:          1,
		{"10", PriorityRejected}:         1,
		{"-3", PriorityRejected}:         1,
	}
	if got := fcfs.ReceivedPriorities(); !reflect.DeepEqual(want, got) {
		t.Errorf("fcfs priorities: got %v, want %v", got, want)
	}
	m := mustMetrics(t, fcfs)
	for _, line := range []string{
		`vllm_sim:request_priority_total{engine="0",model_name="` + fcfs.names[0] + `",priority="10",outcome="rejected"} 1.0`,
		`vllm_sim:request_priority_total{engine="0",model_name="` + fcfs.names[0] + `",priority="none",outcome="accepted"} 1.0`,
		"# TYPE vllm_sim:request_priority_total counter",
	} {
		if !strings.Contains(m, line+"\n") {
			t.Errorf("metrics lack %q:\n%s", line, tail(m, 2000))
		}
	}

	prio := startSim(t, func(c *Config) { c.SchedulingPolicy = PolicyPriority })
	if got := prio.ReceivedPriorities(); len(got) != 0 {
		t.Errorf("fresh server: %v", got)
	}
	for _, p := range []int{10, 10, -5} {
		prio.do("/v1/chat/completions", chatBody("x", map[string]any{"max_tokens": 1, "priority": p}), http.StatusOK, nil)
	}
	prio.do("/v1/embeddings", map[string]any{"model": prio.names[0], "input": "x", "priority": 20}, http.StatusOK, nil)
	want = map[PriorityKey]uint64{{"10", PriorityAccepted}: 2, {"-5", PriorityAccepted}: 1, {"20", PriorityAccepted}: 1}
	if got := prio.ReceivedPriorities(); !reflect.DeepEqual(want, got) {
		t.Errorf("priority engine: got %v, want %v", got, want)
	}
}
