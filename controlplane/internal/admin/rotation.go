package admin

import (
	"encoding/json"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"
)

// rotationAfter is the after JSON of a rotation's audit record: the
// object as it is after the rotation, plus the grace given
// ("grace_period", as requested, "0s" without one) and, with a grace,
// until when the previous token stays valid ("old_token_valid_until").
func rotationAfter(obj proto.Message, grace time.Duration, until *time.Time) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(auditJSON(obj), &m); err != nil {
		return nil, fmt.Errorf("decode rotation audit: %w", err)
	}
	if m == nil {
		m = map[string]json.RawMessage{}
	}
	g, _ := json.Marshal(grace.String())
	m["grace_period"] = g
	if until != nil {
		u, _ := json.Marshal(until.UTC().Format(time.RFC3339Nano))
		m["old_token_valid_until"] = u
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode rotation audit: %w", err)
	}
	return b, nil
}
