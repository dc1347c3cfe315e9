package store

import (
	"encoding/binary"
	"math"
	"time"
)

// The spend logs are staged with COPY in PostgreSQL's binary format,
// encoded here column by column rather than through pgx's type map: per
// row that is a few hundred bytes appended to one buffer instead of 29
// boxed values each looked up, planned and encoded (most of the control
// plane's CPU per usage event). The layout must follow spendLogColumns
// and the column types of spend_logs; a test compares it with rows
// written by pgx.

// pgEpochUnixMicros is PostgreSQL's timestamp epoch (2000-01-01 UTC) in
// microseconds since the Unix epoch.
const pgEpochUnixMicros = 946_684_800_000_000

// pgMicros is t as a binary timestamptz: microseconds since 2000-01-01
// UTC, sub-microseconds truncated (as pgx encodes it).
func pgMicros(t time.Time) int64 {
	return t.Unix()*1_000_000 + int64(t.Nanosecond())/1000 - pgEpochUnixMicros
}

// oidText is the type oid of text, the element type of spend_logs.tags.
const oidText = 25

// copyBinaryHeader starts a binary COPY stream: signature, flags, no
// header extension.
var copyBinaryHeader = []byte("PGCOPY\n\xff\r\n\x00\x00\x00\x00\x00\x00\x00\x00\x00")

// appendSpendCopy appends l as one binary COPY tuple of spendLogColumns.
func appendSpendCopy(b []byte, l *SpendLog) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(spendLogColumns)))
	b = copyText(b, l.RequestID)
	b = copyInt64(b, pgMicros(l.At)) // timestamptz
	for _, s := range [...]string{l.Region, l.InstanceID, l.OrgID, l.TeamID, l.UserID, l.KeyID,
		l.Project, l.Customer, l.AgentID, l.SessionID} {
		b = copyText(b, s)
	}
	b = copyTextArray(b, l.Tags)
	for _, s := range [...]string{l.TrafficClass, l.Route, l.RequestedModel, l.ModelGroup, l.DeploymentID} {
		b = copyText(b, s)
	}
	b = binary.BigEndian.AppendUint32(b, 1)
	if l.Stream {
		b = append(b, 1)
	} else {
		b = append(b, 0)
	}
	for _, n := range [...]int64{l.PromptTokens, l.CompletionTokens, l.CachedTokens, l.CacheCreationTokens} {
		b = copyInt64(b, n)
	}
	b = copyInt64(b, int64(math.Float64bits(l.CostUSD)))
	b = copyInt32(b, l.Status)
	b = copyText(b, l.ErrorCode)
	b = copyInt64(b, l.LatencyMS)
	b = copyInt64(b, l.TTFTMS)
	return copyInt32(b, l.Attempts)
}

func copyText(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

func copyInt64(b []byte, n int64) []byte {
	b = binary.BigEndian.AppendUint32(b, 8)
	return binary.BigEndian.AppendUint64(b, uint64(n))
}

func copyInt32(b []byte, n int32) []byte {
	b = binary.BigEndian.AppendUint32(b, 4)
	return binary.BigEndian.AppendUint32(b, uint32(n))
}

// copyTextArray appends a one-dimensional text[] without nulls (an empty
// array has no dimension).
func copyTextArray(b []byte, ss []string) []byte {
	n := 12
	if len(ss) > 0 {
		n += 8
	}
	for _, s := range ss {
		n += 4 + len(s)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(n))
	dims := uint32(0)
	if len(ss) > 0 {
		dims = 1
	}
	b = binary.BigEndian.AppendUint32(b, dims)
	b = binary.BigEndian.AppendUint32(b, 0) // no nulls
	b = binary.BigEndian.AppendUint32(b, oidText)
	if len(ss) > 0 {
		b = binary.BigEndian.AppendUint32(b, uint32(len(ss)))
		b = binary.BigEndian.AppendUint32(b, 1) // lower bound
	}
	for _, s := range ss {
		b = copyText(b, s)
	}
	return b
}
