package gateway

import (
	"fmt"
	"net/http"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// unseeded answers a request one of whose budget windows Redis does not
// hold (first use, or Redis lost its state) and could not be re-seeded
// from the ledger in time (the control plane unreachable or slow, Postgres
// down): 503 limits_recovering, retryable, nothing consumed
// (docs/limits.md, "Budget seeds").
func (x *exchange) unseeded(w http.ResponseWriter, r *limits.Rejection) *openai.Error {
	h := x.h
	h.m.limitsUnavailable.WithLabelValues("seed").Inc()
	h.log.Warn("budget not re-seeded from the ledger; request refused", "request_id", x.id,
		"scope", r.Scope.String(), "error", r.Cause)
	w.Header().Set(openai.HeaderLimitScope, r.Scope.String())
	w.Header().Set(openai.HeaderLimitType, string(r.Limit))
	return openai.Unavailable(openai.CodeLimitsRecovering,
		fmt.Sprintf("the budget of %s %s is being read from the ledger (the limits store does not hold it: first use, or it lost its state); retry shortly", r.Scope.Kind, r.Scope.ID),
		max(r.RetryAfter, time.Second))
}
