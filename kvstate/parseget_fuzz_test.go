package kvstate

import "testing"

// FuzzParseGet: a STREAM.MSG.GET response (from the server, or whatever
// answers on its subject) never panics the store's reader; a value it
// and an error never come together.
func FuzzParseGet(f *testing.F) {
	f.Add([]byte(`{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","message":{"subject":"$KV.rl_state.k","seq":12,"data":"AQIDBA==","time":"2026-12-03T10:00:00Z"}}`))
	f.Add([]byte(`{"message":{"subject":"$KV.rl_state.k","seq":13,"hdrs":"TkFUUy8xLjANCktWLU9wZXJhdGlvbjogREVMDQoNCg==","time":"2026-12-03T10:00:00Z"}}`))
	f.Add([]byte(`{"error":{"code":404,"err_code":10037,"description":"no message found"}}`))
	f.Add([]byte(`{"message":{"seq":1,"hdrs":"TkFUUy8xLjANCg=="}}`))
	f.Add([]byte(`{"message":null}`))
	s := &JetStreamStore{}
	f.Fuzz(func(t *testing.T, data []byte) {
		val, _, err := s.parseGet("k", data)
		if err != nil && val != nil {
			t.Fatalf("error %v with a value", err)
		}
	})
}
