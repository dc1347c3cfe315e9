package spend

import (
	"errors"
	"fmt"
	"math"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/sluicegw/sluice/controlplane/internal/store"
)

// A UsageBatch is decoded by hand, straight into ledger rows: no
// UsageEvent is built, and every string of the batch is a substring of
// one copy of the message (one allocation per message instead of about
// twenty per event), which the rows keep alive until they are recorded.
// It reads what proto.Unmarshal reads (a test decodes the same batches
// both ways): the last value of a field wins, unknown fields are
// skipped, strings must be valid UTF-8 and a malformed batch fails whole.

// Field numbers of sluice.usage.v1.UsageBatch and UsageEvent (and of
// google.protobuf.Timestamp).
const (
	fBatchEvents = 120
	fBatchID     = 121

	fRequestID           = 1
	fTime                = 2
	fRegion              = 3
	fInstanceID          = 4
	fKeyID               = 5
	fUserID              = 6
	fTeamID              = 7
	fOrgID               = 8
	fProject             = 9
	fCustomer            = 10
	fAgentID             = 11
	fSessionID           = 12
	fTags                = 13
	fTrafficClass        = 14
	fRoute               = 15
	fRequestedModel      = 16
	fModelGroup          = 17
	fDeploymentID        = 18
	fStream              = 19
	fPromptTokens        = 20
	fCompletionTokens    = 21
	fCachedTokens        = 22
	fCostUSD             = 23
	fStatus              = 24
	fErrorCode           = 25
	fLatencyMS           = 26
	fTTFTMS              = 27
	fAttempts            = 28
	fCacheCreationTokens = 90
	fTrafficClassReason  = 80
	fRoutingReason       = 50
	fServedModelGroup    = 180

	fSeconds = 1
	fNanos   = 2
)

var errMalformed = errors.New("malformed protobuf")

// wireBatch is a decoded UsageBatch.
type wireBatch struct {
	id     string
	events []wireEvent
}

type wireEvent struct {
	log store.SpendLog
	// hasTime: the event carries a valid time (log.At); otherwise the
	// message's stored time applies.
	hasTime bool
}

// parseBatch decodes a UsageBatch.
func parseBatch(data []byte) (wireBatch, error) {
	s := string(data) // the one copy every string points into
	var b wireBatch
	for off := 0; off < len(s); {
		num, typ, n := protowire.ConsumeTag(data[off:])
		if n < 0 || num > protowire.MaxValidNumber { // proto.Unmarshal refuses numbers ConsumeTag lets through
			return wireBatch{}, errMalformed
		}
		off += n
		if (num == fBatchEvents || num == fBatchID) && typ == protowire.BytesType {
			v, m := protowire.ConsumeBytes(data[off:])
			if m < 0 {
				return wireBatch{}, errMalformed
			}
			start := off + m - len(v)
			off += m
			if num == fBatchID {
				if !utf8.Valid(v) {
					return wireBatch{}, fmt.Errorf("batch_id: %w", errInvalidUTF8)
				}
				b.id = s[start:off]
				continue
			}
			ev, err := parseEvent(s, data, start, off)
			if err != nil {
				return wireBatch{}, fmt.Errorf("event %d: %w", len(b.events), err)
			}
			b.events = append(b.events, ev)
			continue
		}
		m := protowire.ConsumeFieldValue(num, typ, data[off:])
		if m < 0 {
			return wireBatch{}, errMalformed
		}
		off += m
	}
	return b, nil
}

var errInvalidUTF8 = errors.New("string field contains invalid UTF-8")

// parseEvent decodes the UsageEvent in data[start:end] (s is data as a
// string).
func parseEvent(s string, data []byte, start, end int) (wireEvent, error) {
	var (
		ev      wireEvent
		l       = &ev.log
		sec     int64
		nanos   int32
		hasTime bool
		unkept  string
	)
	data = data[:end]
	for off := start; off < end; {
		num, typ, n := protowire.ConsumeTag(data[off:])
		if n < 0 || num > protowire.MaxValidNumber { // proto.Unmarshal refuses numbers ConsumeTag lets through
			return ev, errMalformed
		}
		off += n
		if dst := stringField(l, num, &unkept); dst != nil || num == fTags || num == fTime {
			if typ != protowire.BytesType {
				goto skip
			}
			v, m := protowire.ConsumeBytes(data[off:])
			if m < 0 {
				return ev, errMalformed
			}
			vs, ve := off+m-len(v), off+m
			off += m
			if num == fTime {
				var err error
				// A repeated message field merges into the first.
				if sec, nanos, err = parseTimestamp(data[vs:ve], sec, nanos); err != nil {
					return ev, err
				}
				hasTime = true
				continue
			}
			if !utf8.Valid(v) {
				return ev, errInvalidUTF8
			}
			if num == fTags {
				l.Tags = append(l.Tags, s[vs:ve])
			} else {
				*dst = s[vs:ve]
			}
			continue
		}
		switch num {
		case fStream, fPromptTokens, fCompletionTokens, fCachedTokens, fStatus, fLatencyMS, fTTFTMS, fAttempts, fCacheCreationTokens:
			if typ != protowire.VarintType {
				break
			}
			v, m := protowire.ConsumeVarint(data[off:])
			if m < 0 {
				return ev, errMalformed
			}
			off += m
			switch num {
			case fStream:
				l.Stream = v != 0
			case fPromptTokens:
				l.PromptTokens = int64(v)
			case fCompletionTokens:
				l.CompletionTokens = int64(v)
			case fCachedTokens:
				l.CachedTokens = int64(v)
			case fCacheCreationTokens:
				l.CacheCreationTokens = int64(v)
			case fStatus:
				l.Status = int32(v)
			case fLatencyMS:
				l.LatencyMS = int64(v)
			case fTTFTMS:
				l.TTFTMS = int64(v)
			case fAttempts:
				l.Attempts = int32(v)
			}
			continue
		case fCostUSD:
			if typ != protowire.Fixed64Type {
				break
			}
			v, m := protowire.ConsumeFixed64(data[off:])
			if m < 0 {
				return ev, errMalformed
			}
			off += m
			l.CostUSD = math.Float64frombits(v)
			continue
		}
	skip:
		m := protowire.ConsumeFieldValue(num, typ, data[off:])
		if m < 0 {
			return ev, errMalformed
		}
		off += m
	}
	// Timestamp.CheckValid's range: 0001-01-01 to 9999-12-31, nanos in
	// [0, 1e9).
	if hasTime && sec >= -62135596800 && sec <= 253402300799 && nanos >= 0 && nanos < 1e9 {
		l.At, ev.hasTime = time.Unix(sec, int64(nanos)).UTC(), true
	}
	return ev, nil
}

// stringField is where a string field of UsageEvent goes; skip is a
// throwaway target for the string fields the ledger does not keep (whose
// UTF-8 is checked all the same); nil: not a string field.
func stringField(l *store.SpendLog, num protowire.Number, skip *string) *string {
	switch num {
	case fRequestID:
		return &l.RequestID
	case fRegion:
		return &l.Region
	case fInstanceID:
		return &l.InstanceID
	case fKeyID:
		return &l.KeyID
	case fUserID:
		return &l.UserID
	case fTeamID:
		return &l.TeamID
	case fOrgID:
		return &l.OrgID
	case fProject:
		return &l.Project
	case fCustomer:
		return &l.Customer
	case fAgentID:
		return &l.AgentID
	case fSessionID:
		return &l.SessionID
	case fTrafficClass:
		return &l.TrafficClass
	case fRoute:
		return &l.Route
	case fRequestedModel:
		return &l.RequestedModel
	case fModelGroup:
		return &l.ModelGroup
	case fDeploymentID:
		return &l.DeploymentID
	case fErrorCode:
		return &l.ErrorCode
	case fTrafficClassReason, fRoutingReason, fServedModelGroup:
		return skip
	}
	return nil
}

// parseTimestamp decodes a google.protobuf.Timestamp over sec and nanos.
func parseTimestamp(data []byte, sec int64, nanos int32) (int64, int32, error) {
	for off := 0; off < len(data); {
		num, typ, n := protowire.ConsumeTag(data[off:])
		if n < 0 || num > protowire.MaxValidNumber { // proto.Unmarshal refuses numbers ConsumeTag lets through
			return 0, 0, errMalformed
		}
		off += n
		if (num == fSeconds || num == fNanos) && typ == protowire.VarintType {
			v, m := protowire.ConsumeVarint(data[off:])
			if m < 0 {
				return 0, 0, errMalformed
			}
			off += m
			if num == fSeconds {
				sec = int64(v)
			} else {
				nanos = int32(v)
			}
			continue
		}
		m := protowire.ConsumeFieldValue(num, typ, data[off:])
		if m < 0 {
			return 0, 0, errMalformed
		}
		off += m
	}
	return sec, nanos, nil
}
